"""Shared fixtures: synthetic data written once, and an in-process run of the real loop."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from minirl.config.load import load_config
from minirl.dist.context import DistContext
from minirl.plugins import PluginManager

ROOT = Path(__file__).resolve().parents[2]


def _make_data_module():
    spec = importlib.util.spec_from_file_location("make_data", ROOT / "scripts" / "make_data.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_data"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data")
    make_data = _make_data_module()
    for task in ("copy", "gsm8k"):
        make_data.write_task(task, out, 400, 50, 0)
    return out


def cli_args(run_root: Path, train_file: Path | str, *overrides: str) -> list[str]:
    """The arguments of `python -m minirl` for a short run of bench.toml's cpu profile on one
    parquet file: metrics to jsonl, no validation, no progress bar."""
    return [
        "--config",
        str(ROOT / "bench.toml"),
        "--profile",
        "cpu",
        f'data.train_files=["{train_file}"]',
        f"trainer.default_local_dir={run_root}",
        "trainer.progress_bar=false",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        'trainer.logger=["jsonl"]',
        *overrides,
    ]


def run_job(tmp_path: Path, data_dir: Path, overrides: list[str], profile: str = "cpu", device: str = "cpu"):
    """Run `python -m minirl --config bench.toml --profile cpu <overrides>` in this process."""
    return make_trainer(tmp_path, data_dir, overrides, profile, device).fit()


def make_trainer(tmp_path: Path, data_dir: Path, overrides: list[str], profile: str = "cpu", device: str = "cpu"):
    """The Trainer that `run_job` runs, for tests that inspect it after fit()."""
    base = [
        f'data.train_files=["{data_dir}/copy/train.parquet"]',
        f'data.val_files=["{data_dir}/copy/test.parquet"]',
        f"trainer.default_local_dir={tmp_path}",
        "trainer.progress_bar=false",
        "trainer.val_before_train=false",  # tests that validate say so
        "trainer.test_freq=-1",
    ]
    cfg = load_config(str(ROOT / "bench.toml"), base + overrides, profile=profile)
    from minirl.trainer import Trainer

    return Trainer(cfg, PluginManager(cfg.plugins.modules), DistContext(device=torch.device(device)))
