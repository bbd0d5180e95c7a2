"""Shared pieces of the distributed parity tests: a tiny model, a batch, and a way to return
results from spawned workers to the test (rank 0 writes JSON, the test reads it).

Each test file spawns its 2 workers once (a module fixture) and checks several properties of
the result: starting processes that import torch and transformers costs seconds on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from minirl.config.load import load_config
from minirl.models.loading import random_model
from minirl.models.presets import preset_config

SEED = 3
ROOT = Path(__file__).resolve().parents[2]


def config(*overrides: str):
    return load_config(None, ["trainer.device='cpu'", "trainer.collective_timeout_s=120", *overrides])


def tiny_model(seed: int = SEED, **config_overrides) -> torch.nn.Module:
    """The `tiny` preset (Qwen2 shape: 4 heads, 2 KV heads, untied) with seeded random weights."""
    cfg = preset_config("tiny")
    for key, value in config_overrides.items():
        setattr(cfg, key, value)
    return random_model(cfg, "cpu", torch.float32, seed=seed)


def sequences(prompt_lens: list[int], response_lens: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 250, (n,), generator=g).tolist() for n in prompt_lens]
    responses = [torch.randint(1, 250, (n,), generator=g).tolist() for n in response_lens]
    return prompts, responses


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.full_tensor() if hasattr(a, "full_tensor") else a
    b = b.full_tensor() if hasattr(b, "full_tensor") else b
    # .cpu(): a CPU-offloaded shard is compared with one that lives on the GPU
    return float((a.detach().float().cpu() - b.detach().float().cpu()).abs().max()) if a.numel() else 0.0


def max_param_err(model_a, model_b, grads: bool = False) -> float:
    """Largest difference over all parameters (or their gradients), matched by name."""
    b = dict(model_b.named_parameters())
    errs = []
    for name, pa in model_a.named_parameters():
        pb = b[name]
        errs.append(max_err(pa.grad, pb.grad) if grads else max_err(pa, pb))
    return max(errs)


def write_results(path: str, rank: int, results: dict) -> None:
    if rank == 0:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


def read_results(path) -> dict:
    with open(path) as f:
        return json.load(f)


def run_cli(
    tmp_path: Path, data_dir: Path, *overrides: str, launcher: list[str] | None = None
) -> subprocess.CompletedProcess:
    """`python -m minirl --config bench.toml --profile cpu` at world size 2, made small: 4 prompts
    x 2 samples per step, 2 mini-batches. This directory is on PYTHONPATH (for test plugins).
    `launcher` replaces `python -m` (e.g. torchrun's command line ending in -m)."""
    args = [*(launcher or [sys.executable, "-m"]), "minirl", *cli_args(tmp_path, data_dir, *overrides)]
    path = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        args, cwd=ROOT, env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True, timeout=400, check=False
    )


def cli_args(tmp_path: Path, data_dir: Path, *overrides: str) -> list[str]:
    """The arguments after `minirl` of run_cli's job."""
    return [
        "--config",
        str(ROOT / "bench.toml"),
        "--profile",
        "cpu",
        f'data.train_files=["{data_dir}/copy/train.parquet"]',
        f"trainer.default_local_dir={tmp_path}",
        "trainer.progress_bar=false",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.world_size=2",
        "trainer.collective_timeout_s=120",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=2",
        "rollout.n=2",
        *overrides,
    ]
