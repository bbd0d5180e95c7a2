"""The critic under Ulysses sequence parallelism (sp = 2, composed with FSDP2 over both ranks, gloo)
against one process: the same values and the same critic update, through the actor's assembly
hooks with no critic code in the Ulysses plugin; one batch has a slice that predicts no response
token (it must still run its backward, or the sp all-to-alls would not pair up)."""

from __future__ import annotations

import dist_helpers as h
import pytest
import torch

from minirl import build
from minirl.batch import RolloutBatch, response_mask
from minirl.critic import resolved
from minirl.critic import update as critic_lib
from minirl.critic.model import add_value_head
from minirl.dist import spmd
from minirl.dist.context import DistContext
from minirl.dist.launchers import spawn
from minirl.models import assembly
from minirl.plugins import PluginManager

pytestmark = pytest.mark.distributed

CPU = torch.device("cpu")
N = 2
CFG = (
    "trainer.world_size=2",
    "actor.ulysses_sequence_parallel_size=2",
    "critic.ulysses_sequence_parallel_size=2",
    "data.train_batch_size=2",
    "actor.ppo_mini_batch_size=2",
    f"rollout.n={N}",
    "critic.ppo_micro_batch_size_per_gpu=1",  # one sequence per row: the long prompt fills a slice
    "critic.cliprange_value=0.1",
    "critic.optim.lr=0.01",
    "critic.optim.eps=1e-4",
    "data.max_response_length=16",
)
BATCHES = {  # (prompt lengths, response lengths) of 2 prompts x N samples
    "mixed": ([5, 9], [7, 2, 11, 4]),
    "empty_slice": ([40, 3], [3, 2, 1, 2]),  # the long prompt fills the first slice of its row
}


def _value_model() -> torch.nn.Module:
    return add_value_head(h.tiny_model(), seed=5)


def _batch(prompt_lens, response_lens) -> RolloutBatch:
    prompts, _ = h.sequences(prompt_lens, [1] * len(prompt_lens), seed=1)
    _, responses = h.sequences([1] * len(response_lens), response_lens, seed=2)
    mask_BT = response_mask(responses, CPU)
    batch = RolloutBatch([p for p in prompts for _ in range(N)], responses, torch.tensor([0, 0, 1, 1]), mask_BT)
    g = torch.Generator().manual_seed(0)
    batch.values_BT = 0.3 * torch.randn(mask_BT.shape, generator=g) * mask_BT
    batch.returns_BT = torch.randn(mask_BT.shape, generator=g) * mask_BT
    return batch


def _compare(tag: str, cfg, dist, pm, results) -> None:
    ccfg = resolved(cfg.critic, cfg.actor)  # unset critic keys take the actor's
    batch = _batch(*BATCHES[tag])
    plain = _value_model()
    critic = assembly.assemble_critic(pm, _value_model(), ccfg, dist)
    results[f"{tag}/sp"] = hasattr(critic, "minirl_sequence_parallel")
    one = DistContext(device=CPU)
    results[f"{tag}/values_err"] = h.max_err(
        critic_lib.compute_values(build.critic_from_model(cfg, critic, None, None, dist), batch, dist),
        critic_lib.compute_values(build.critic_from_model(cfg, plain, None, None, one), batch, one),
    )
    updates = {}
    for name, model, d in (("plain", plain, one), ("sp", critic, dist)):
        optimizer, _ = assembly.build_optimizer(pm, model, ccfg.optim, 10)
        job = build.critic_from_model(cfg, model, optimizer, None, d)
        updates[name] = critic_lib.update_critic(job, batch, d)
    results[f"{tag}/param_err"] = h.max_param_err(critic, plain)
    results[f"{tag}/moved"] = h.max_param_err(plain, _value_model())
    results[f"{tag}/metric_err"] = max(abs(updates["sp"][k] - updates["plain"][k]) for k in updates["plain"])


def _worker(rank: int, out_path: str) -> None:
    cfg = h.config(*CFG)
    dist = spmd.init_from_env(cfg)
    pm = PluginManager(entry_points=False)
    results = {}
    for tag in BATCHES:
        _compare(tag, cfg, dist, pm, results)
    h.write_results(out_path, rank, results)
    spmd.shutdown()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("critic_ulysses") / "results.json"
    assert spawn.spawn(_worker, 2, (str(out),)) == 0, "a worker failed: see its traceback above"
    return h.read_results(out)


@pytest.mark.parametrize("tag", sorted(BATCHES))
def test_sp2_critic_equals_one_process(results, tag):
    assert results[f"{tag}/sp"], "the Ulysses hook did not apply to the critic"
    assert results[f"{tag}/values_err"] < 1e-5
    assert results[f"{tag}/moved"] > 1e-3
    assert results[f"{tag}/param_err"] < 1e-6
    assert results[f"{tag}/metric_err"] < 1e-5
