"""The loop on one CUDA device: bf16 rollout in the native engine, fp32 master weights, packed
varlen attention under autocast, KV cache released and resumed around every generation."""

from __future__ import annotations

import pytest
import torch

from tests.integration.conftest import run_job

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("engine", ["native", "hf"])
def test_tiny_job_on_cuda(tmp_path, data_dir, engine):
    history = run_job(
        tmp_path,
        data_dir,
        ["trainer.total_training_steps=2", "trainer.device=cuda", f"rollout.name={engine}"],
        device="cuda",
    )
    assert len(history) == 2
    for metrics in history:
        assert metrics["timing_s/gen"] > 0 and metrics["perf/gen_throughput_per_gpu"] > 0
        assert torch.isfinite(torch.tensor(metrics["actor/pg_loss"]))
        assert "memory_gib/update_actor" in metrics
