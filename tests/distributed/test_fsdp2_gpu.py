"""FSDP2 and Ulysses on 2 GPUs (NCCL): bf16 mixed precision against fp32 on one process, CPU
offload of parameters or of optimizer state against no offload, and the weight sync of an
offloaded actor. Skipped without 2 CUDA devices."""

from __future__ import annotations

import dist_helpers as h
import pytest
import torch

from minirl import assembly, spmd
from minirl.forward import response_logprobs
from minirl.launchers import spawn
from minirl.plugins import PluginManager

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.distributed,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

BASE = (
    "trainer.device='cuda'",
    "trainer.n_gpus_per_node=2",
    "data.train_batch_size=2",
    "actor.ppo_mini_batch_size=2",
    "actor.optim.lr=0.01",
    "actor.optim.eps=1e-4",
)
PROMPT_LENS, RESPONSE_LENS = [5, 9, 3, 12], [7, 2, 11, 4]


def _step(model, pm, cfg, prompts, responses, device):
    """One AdamW step on -mean(logp); returns the loss."""
    optimizer, _ = assembly.build_optimizer(pm, model, cfg.actor.optim, 10)
    logp, _ = response_logprobs(model, prompts, responses, 1.0, device)
    loss = -logp.sum() / sum(RESPONSE_LENS)
    loss.backward()
    optimizer.step()
    return loss.detach(), optimizer


def _variant(pm, dist, rank, overrides, prompts, responses):
    cfg = h.config(*BASE, *overrides)
    actor = assembly.assemble_actor(pm, h.tiny_model().to(dist.device), cfg, dist)
    mine = [2 * rank, 2 * rank + 1]
    loss, optimizer = _step(actor, pm, cfg, [prompts[i] for i in mine], [responses[i] for i in mine], dist.device)
    return actor, loss, optimizer


def _worker(rank: int, out_path: str) -> None:
    from minirl_plugins.native import weights_checksum

    dist = spmd.init_from_env(h.config(*BASE))
    pm = PluginManager(entry_points=False)
    prompts, responses = h.sequences(PROMPT_LENS, RESPONSE_LENS)
    plain = h.tiny_model().to(dist.device)
    _step(plain, pm, h.config(*BASE), prompts, responses, dist.device)
    results = {}
    base, _, _ = _variant(pm, dist, rank, (), prompts, responses)
    results["bf16_vs_fp32_param_err"] = h.max_param_err(base, plain)
    offloaded, _, _ = _variant(pm, dist, rank, ("actor.fsdp_config.param_offload=true",), prompts, responses)
    results["param_offload_is_on_cpu"] = all(p.to_local().device.type == "cpu" for p in offloaded.parameters())
    results["param_offload_err"] = h.max_param_err(offloaded, base)
    results["param_offload_sync_matches"] = weights_checksum(
        assembly.full_weights(offloaded), torch.float32
    ) == weights_checksum(assembly.full_weights(base), torch.float32)
    opt_off, _, optimizer = _variant(pm, dist, rank, ("actor.fsdp_config.optimizer_offload=true",), prompts, responses)
    results["optimizer_offload_err"] = h.max_param_err(opt_off, base)
    results["optimizer_state_on_cpu"] = all(
        v.device.type == "cpu" for state in optimizer.state.values() for v in state.values() if v.dim() > 0
    )
    h.write_results(out_path, rank, results)
    spmd.shutdown()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2_gpu") / "results.json"
    assert spawn.spawn(_worker, 2, (str(out),)) == 0, "a worker failed: see its traceback above"
    return h.read_results(out)


def test_bf16_mixed_precision_stays_close_to_fp32(results):
    """bf16 compute, fp32 reduction and master weights: one lr=0.01 step within bf16 noise."""
    assert results["bf16_vs_fp32_param_err"] < 2e-3


def test_param_offload_gives_the_same_step(results):
    assert results["param_offload_is_on_cpu"]
    assert results["param_offload_err"] < 1e-5
    assert results["param_offload_sync_matches"]


def test_optimizer_offload_gives_the_same_step_and_keeps_state_on_cpu(results):
    assert results["optimizer_offload_err"] < 1e-6
    assert results["optimizer_state_on_cpu"]
