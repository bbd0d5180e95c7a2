"""Compiling ahead (model.precompile, minirl/precompile.py) with the real twin: on the CPU, every
graph the trainer compiles in step 1 is one the twin left in inductor's cache, for a model deeper
than the twin (recomputed and kept layers, a reference) and for LoRA (layer 0's own variant), and
a run that loads them computes what a run that compiles them does, bit for bit; on a GPU (the
`gpu` marker), a run with its twin finds all of them.

Each run is a fresh process with its own TORCHINDUCTOR_CACHE_DIR, so nothing is found in memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import ROOT, cli_args

TWIN = (
    "import sys\n"
    "from minirl import precompile\n"
    "from minirl.config.load import load_config\n"
    "cfg = load_config(sys.argv[1], sys.argv[2:], profile='cpu')\n"
    "precompile.run_twin(cfg, precompile.twin_passes(cfg))\n"
)


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory) -> Path:
    """The tiny preset with four decoder layers (the twin has three), as a Hugging Face directory."""
    from minirl.models.loading import random_model
    from minirl.models.presets import preset_config
    from minirl.models.tokenizers import byte_tokenizer

    out = tmp_path_factory.mktemp("tiny4")
    random_model(preset_config("tiny", num_hidden_layers=4), "cpu", torch.float32).save_pretrained(out)
    byte_tokenizer().save_pretrained(out)
    return out


def _env(cache: Path) -> dict[str, str]:
    return {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(cache),
        "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
    }


def _twin(cache: Path, overrides: list[str]) -> None:
    cmd = [sys.executable, "-c", TWIN, str(ROOT / "bench.toml"), *overrides]
    subprocess.run(cmd, env=_env(cache), cwd=ROOT, check=True, timeout=900, capture_output=True)


def _job(run_root: Path, cache: Path, train_file: Path, overrides: list[str], precompile: bool = False) -> dict:
    args = cli_args(
        run_root, train_file, *overrides, "trainer.experiment_name=run", f"model.precompile={str(precompile).lower()}"
    )
    done = subprocess.run(
        [sys.executable, "-m", "minirl", *args], env=_env(cache), cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((run_root / "run" / "metrics.jsonl").read_text().splitlines()[0])


STEP = ["model.compile_layers=true", "trainer.total_training_steps=1", "data.train_batch_size=4", "rollout.n=4"]
STEP += ["actor.ppo_mini_batch_size=2", "actor.use_kl_loss=true"]  # a prev-log-prob pass and a reference
KEYS = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl")


def test_the_twin_compiles_every_graph_of_a_deeper_model_and_the_run_computes_the_same(tmp_path, data_dir, deep_model):
    overrides = [*STEP, f"model.path={deep_model}", "model.enable_gradient_checkpointing=true"]
    overrides += ["model.recompute_num_layers=2"]  # layers 0-1 recompute, 2-3 keep
    train = data_dir / "copy" / "train.parquet"
    _twin(tmp_path / "cache", overrides)
    warm = _job(tmp_path / "warm", tmp_path / "cache", train, overrides)
    assert warm["compile/cache_misses"] == 0 and warm["compile/cache_hits"] >= 6, warm
    cold = _job(tmp_path / "cold", tmp_path / "cold_cache", train, overrides)
    assert cold["compile/cache_misses"] >= 6 and cold["compile/graphs"] == warm["compile/graphs"]
    assert {k: warm[k] for k in KEYS} == {k: cold[k] for k in KEYS}  # the same graphs: the same bits


def test_the_twin_compiles_every_graph_of_a_lora_run(tmp_path, data_dir):
    """LoRA: the reference is the actor with its adapters off (graphs of their own); layer 0, under
    the frozen embedding, runs the other layers' graphs (minirl.models.compile)."""
    overrides = [*STEP, "model.lora_rank=4", "model.lora_alpha=8"]
    _twin(tmp_path / "cache", overrides)
    warm = _job(tmp_path / "warm", tmp_path / "cache", data_dir / "copy" / "train.parquet", overrides)
    assert warm["compile/cache_misses"] == 0 and warm["compile/cache_hits"] >= 5, warm


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_run_finds_every_graph_its_twin_compiled(tmp_path, data_dir):
    """The hand-over in a run on a GPU, at the 1.5B shape: FSDP2 on a one-rank group, bf16
    matmuls over float32 masters, the fused MLP in the gradient-free passes, LoRA (its own
    reference), 7 layers recomputed and the rest kept. The trainer waited for the
    twin's two passes (model.precompile_wait_s: this run's generation is too short to hide them)
    and compiled nothing itself."""
    overrides = [*STEP, "trainer.device=cuda", "model.preset=qwen2-1.5b", "model.fused_mlp=true"]
    overrides += ["model.lora_rank=8", "model.lora_alpha=16", "model.enable_gradient_checkpointing=true"]
    overrides += ["model.recompute_num_layers=7", "rollout.gpu_memory_utilization=0.3", "model.precompile_wait_s=600"]
    run = _job(tmp_path / "run", tmp_path / "cache", data_dir / "copy" / "train.parquet", overrides, precompile=True)
    assert run["compile/precompile_passes"] == 2, run
    assert run["compile/cache_misses"] == 0 and run["compile/cache_hits"] >= 6, run
