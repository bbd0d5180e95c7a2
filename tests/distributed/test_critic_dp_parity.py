"""The critic at dp = 2 (gloo, FSDP2 through the same assembly hooks as the actor) against one
process: the values pass gives the same values, and the critic update the same parameters and
metrics, although the ranks split their mini-batches into micro-batches differently (the value
loss is normalised by counts of the whole global mini-batch, as the policy loss).

The global mini-batch i is the union of every rank's i-th mini-batch; the one-process batch is
ordered so that its mini-batches are those unions (prompts p0, p2 | p1, p3), as in
test_dp_update_parity.py.
"""

from __future__ import annotations

import dist_helpers as h
import pytest
import torch

from minirl import build
from minirl.batch import RolloutBatch, response_mask
from minirl.critic import update as critic_lib
from minirl.critic.model import add_value_head
from minirl.dist import spmd
from minirl.dist.context import DistContext
from minirl.dist.launchers import spawn
from minirl.models import assembly
from minirl.plugins import PluginManager

pytestmark = pytest.mark.distributed

CPU = torch.device("cpu")
N = 2  # samples per prompt
PROMPTS = {0: (20, [15, 14]), 1: (6, [4, 9]), 2: (5, [3, 2]), 3: (8, [6, 1])}  # p0 long: rank 0 needs 2 micro
ONE_PROCESS_ORDER = [0, 2, 1, 3]
RANK_PROMPTS = {0: [0, 1], 1: [2, 3]}
MODES = ("token-mean", "seq-mean-token-sum")


def _value_model() -> torch.nn.Module:
    return add_value_head(h.tiny_model(), seed=5)


def _full_batch(plain) -> RolloutBatch:
    """All 4 prompts x N samples; old values = the plain critic's plus noise (so that the clip
    engages), returns random."""
    prompts, responses, groups = [], [], []
    for p, (plen, rlens) in PROMPTS.items():
        prompt, _ = h.sequences([plen], [1], seed=10 + p)
        _, rs = h.sequences([1] * N, rlens, seed=20 + p)
        prompts += prompt * N
        responses += rs
        groups += [p] * N
    mask_BT = response_mask(responses, CPU)
    batch = RolloutBatch(prompts, responses, torch.tensor(groups), mask_BT)
    one = DistContext(device=CPU)
    values_BT = critic_lib.compute_values(_critic(_cfg("token-mean"), plain, None, one), batch, one)
    g = torch.Generator().manual_seed(0)
    batch.values_BT = (values_BT + 0.2 * torch.randn(mask_BT.shape, generator=g)) * mask_BT
    batch.returns_BT = torch.randn(mask_BT.shape, generator=g) * mask_BT
    return batch


def _cfg(mode: str):
    return h.config(
        "trainer.world_size=2",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=2",
        "critic.ppo_mini_batch_size=2",
        f"rollout.n={N}",
        "critic.use_dynamic_bsz=true",
        "critic.ppo_max_token_len_per_gpu=40",
        "critic.cliprange_value=0.1",
        "critic.optim.lr=0.01",
        "critic.optim.eps=1e-4",
        f"critic.loss_agg_mode='{mode}'",
        "data.max_response_length=16",
    )


def _critic(cfg, model, optimizer, dist):
    return build.critic_from_model(cfg, model, optimizer, None, dist)  # unset critic keys: the actor's


def _seqs(prompt_ids: list[int]) -> list[int]:
    return [p * N + i for p in prompt_ids for i in range(N)]


def _update(model, batch, cfg, pm, dist) -> dict[str, float]:
    optimizer, _ = assembly.build_optimizer(pm, model, cfg.critic.optim, 10)
    return critic_lib.update_critic(_critic(cfg, model, optimizer, dist), batch, dist)


def _compare(mode: str, rank: int, dist, pm, results) -> None:
    cfg = _cfg(mode)
    plain = _value_model()
    full = _full_batch(plain)
    mine = full.select(_seqs(RANK_PROMPTS[rank]))
    critic = assembly.assemble_critic(pm, _value_model(), cfg.critic, dist)
    one = DistContext(device=CPU)
    got_values = critic_lib.compute_values(_critic(cfg, critic, None, dist), mine, dist)
    want_values = critic_lib.compute_values(_critic(cfg, plain, None, one), mine, one)
    results[f"{mode}/values_err"] = h.max_err(got_values, want_values)
    want = _update(plain, full.select(_seqs(ONE_PROCESS_ORDER)), cfg, pm, DistContext(device=CPU))
    got = _update(critic, mine, cfg, pm, dist)
    results[f"{mode}/param_err"] = h.max_param_err(critic, plain)
    results[f"{mode}/params_moved"] = h.max_param_err(plain, _value_model())
    results[f"{mode}/metric_err"] = max(abs(got[k] - want[k]) for k in want)
    results[f"{mode}/metrics"] = want


def _worker(rank: int, out_path: str) -> None:
    dist = spmd.init_from_env(
        h.config("trainer.world_size=2", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2")
    )
    pm = PluginManager(entry_points=False)
    results = {}
    for mode in MODES:
        _compare(mode, rank, dist, pm, results)
    h.write_results(out_path, rank, results)
    spmd.shutdown()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("critic_dp") / "results.json"
    assert spawn.spawn(_worker, 2, (str(out),)) == 0, "a worker failed: see its traceback above"
    return h.read_results(out)


@pytest.mark.parametrize("mode", MODES)
def test_dp2_critic_equals_one_process(results, mode):
    """Two mini-batches (two AdamW steps) of the clipped value loss, with the clip engaged:
    same values before, same parameters after, same critic/ metrics."""
    metrics = results[f"{mode}/metrics"]
    assert results[f"{mode}/values_err"] < 1e-6
    assert results[f"{mode}/params_moved"] > 1e-3
    assert results[f"{mode}/param_err"] < 1e-6
    assert metrics["critic/vf_clipfrac"] > 0, "the test data should engage the value clip"
    assert {"critic/vf_loss", "critic/vpred_mean", "critic/grad_norm"} <= set(metrics)
    assert results[f"{mode}/metric_err"] < 1e-5
