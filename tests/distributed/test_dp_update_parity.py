"""Data-parallel actor update at dp = 2 against one process: the same update (parameters and
loss metrics) although the ranks split their mini-batches into micro-batches differently,
because every loss is normalised by counts of the whole global mini-batch (docs/algorithms.md §6);
and the ranks agree on one number of micro-batches (FSDP needs every rank to run the same
forward and backward passes).

The global mini-batch i is the union of every rank's i-th mini-batch; the one-process batch is
ordered so that its mini-batches are those unions (prompts p0, p2 | p1, p3).
"""

from __future__ import annotations

import dist_helpers as h
import pytest
import torch
import torch.distributed as tdist

from minirl import build
from minirl.batch import MicroBatching, RolloutBatch, response_mask, select_micro, split_micro
from minirl.dist import spmd
from minirl.dist.context import DistContext
from minirl.dist.launchers import spawn
from minirl.forward.packed import logprob_head, per_token_pass, response_logprobs
from minirl.models import assembly
from minirl.plugins import PluginManager
from minirl.update import actor as actor_lib
from minirl.update import loop

pytestmark = pytest.mark.distributed

CPU = torch.device("cpu")
N = 2  # samples per prompt
# per prompt: (prompt length, response lengths); p0 is long, so rank 0 needs more micro-batches
PROMPTS = {0: (20, [15, 14]), 1: (6, [4, 9]), 2: (5, [3, 2]), 3: (8, [6, 1])}
ONE_PROCESS_ORDER = [0, 2, 1, 3]
RANK_PROMPTS = {0: [0, 1], 1: [2, 3]}
BUDGET = 40  # actor.ppo_max_token_len_per_gpu


def _full_batch(plain) -> RolloutBatch:
    """All 4 prompts x N samples, prompt-major; ranks and the one process select from it."""
    prompts, responses, groups = [], [], []
    for p, (plen, rlens) in PROMPTS.items():
        prompt, _ = h.sequences([plen], [1], seed=10 + p)
        _, rs = h.sequences([1] * N, rlens, seed=20 + p)
        prompts += prompt * N  # the n samples of a prompt share it
        responses += rs
        groups += [p] * N
    mask_BT = response_mask(responses, CPU)
    batch = RolloutBatch(prompts, responses, torch.tensor(groups), mask_BT)
    with torch.no_grad():
        logp_R, _ = response_logprobs(plain, prompts, responses, 1.0, CPU)
    logp_BT = torch.zeros(mask_BT.shape).masked_scatter(mask_BT.bool(), logp_R)
    noise_BT = torch.randn(mask_BT.shape, generator=torch.Generator().manual_seed(0))
    adv_B = torch.tensor([(-1.0) ** i * (1 + g) for i, g in enumerate(groups)])
    batch.old_log_probs_BT = (logp_BT + 0.1 * noise_BT) * mask_BT  # ratios away from 1: clipping engages
    batch.ref_log_probs_BT = (logp_BT - 0.05 * noise_BT.abs()) * mask_BT
    batch.advantages_BT = adv_B[:, None] * mask_BT
    return batch


def _seqs(prompt_ids: list[int]) -> list[int]:
    return [p * N + i for p in prompt_ids for i in range(N)]


def _update(model, batch, cfg, pm, dist, losses) -> dict[str, float]:
    optimizer, _ = assembly.build_optimizer(pm, model, cfg.actor.optim, 10)
    job = build.actor_update(cfg, model, optimizer, losses, dist, on_policy=False)
    return actor_lib.update_actor(job, batch, dist)


def _compare(mode: str, rank: int, dist, pm, results, logprob_pass: bool = False) -> None:
    cfg = h.config(
        "trainer.world_size=2",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=2",
        f"rollout.n={N}",
        "actor.use_dynamic_bsz=true",
        f"actor.ppo_max_token_len_per_gpu={BUDGET}",
        "actor.use_kl_loss=true",
        "actor.kl_loss_coef=0.1",
        "actor.clip_ratio=0.1",
        "actor.optim.lr=0.01",
        "actor.optim.eps=1e-4",
        f"actor.loss_agg_mode='{mode}'",
        "data.max_response_length=16",
    )
    plain = h.tiny_model()
    full = _full_batch(plain)
    losses = actor_lib.Losses(pm["policy_losses"].get("vanilla"), pm["kl_estimators"].get("low_var_kl"))
    counts = _count_micro_batches()
    want = _update(plain, full.select(_seqs(ONE_PROCESS_ORDER)), cfg, pm, DistContext(device=CPU), losses)
    counts.clear()
    actor = assembly.assemble_actor(pm, h.tiny_model(), cfg, dist)
    mine = full.select(_seqs(RANK_PROMPTS[rank]))
    if logprob_pass:  # the trainer's old-log-prob pass: a forward without backward first
        per_token_pass(actor, mine, MicroBatching(4, False, 100), logprob_head(1.0), dist)
        mode = f"{mode}+logprob_pass"
    got = _update(actor, mine, cfg, pm, dist, losses)
    results[f"{mode}/param_err"] = h.max_param_err(actor, plain)
    results[f"{mode}/params_moved"] = h.max_param_err(plain, h.tiny_model())
    results[f"{mode}/metric_err"] = max(abs(got[k] - want[k]) for k in want if k.startswith("actor/"))
    results[f"{mode}/metrics_compared"] = sorted(want)
    all_counts = [None, None]
    tdist.all_gather_object(all_counts, counts)
    results[f"{mode}/micro_counts"] = all_counts


def _count_micro_batches() -> list[tuple[int, int]]:
    """Record (agreed count, this rank's own count) of every micro-batch split of the update."""
    seen = []

    def counting(batch, micro, agree=None, sp_size=1):
        out = split_micro(batch, micro, agree, sp_size)
        seen.append((len(out), len(split_micro(batch, micro, sp_size=sp_size))))
        return out

    loop.split_micro = counting
    return seen


def _worker(rank: int, out_path: str) -> None:
    dist = spmd.init_from_env(
        h.config("trainer.world_size=2", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2")
    )
    pm = PluginManager(entry_points=False)
    results = {}
    for mode in ("token-mean", "seq-mean-token-mean"):
        _compare(mode, rank, dist, pm, results)
    _compare("token-mean", rank, dist, pm, results, logprob_pass=True)
    h.write_results(out_path, rank, results)
    spmd.shutdown()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp_update") / "results.json"
    assert spawn.spawn(_worker, 2, (str(out),)) == 0, "a worker failed: see its traceback above"
    return h.read_results(out)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_dp2_update_equals_one_process(results, mode):
    """Two mini-batches (two AdamW steps) with PPO clip and a KL loss: same parameters and
    the same loss metrics (pg_loss, kl_loss, clip fractions, entropy, grad_norm)."""
    assert results[f"{mode}/params_moved"] > 1e-3
    assert results[f"{mode}/param_err"] < 1e-6
    assert {"actor/pg_loss", "actor/kl_loss", "actor/grad_norm"} <= set(results[f"{mode}/metrics_compared"])
    assert results[f"{mode}/metric_err"] < 1e-5


def test_update_after_a_logprob_pass_equals_one_process(results):
    """The old-log-prob pass (a forward without backward) leaves FSDP2's last decoder layer
    gathered; unless every sharded module is resharded after it, the update's second mini-batch
    ran on that layer's stale pre-update copy (a parameter error of about 2·lr)."""
    assert results["token-mean+logprob_pass/param_err"] < 1e-6
    assert results["token-mean+logprob_pass/metric_err"] < 1e-5


def test_ranks_agree_on_the_number_of_micro_batches(results):
    """Rank 0 (long sequences) needs 2 micro-batches for its first mini-batch, rank 1 only 1;
    both run 2, or FSDP's collectives would not pair up."""
    rank0, rank1 = results["token-mean/micro_counts"]
    assert [agreed for agreed, _ in rank0] == [agreed for agreed, _ in rank1]
    assert any(own < agreed for agreed, own in rank1), "the test data should make the ranks disagree"


# ---------------------------------------------------------------------------------------------
# no processes needed
# ---------------------------------------------------------------------------------------------


def test_a_rank_with_fewer_sequences_gets_placeholder_micro_batches():
    """When another rank needs more micro-batches than this one has sequences, the extra ones
    are placeholders: a real sequence with an all-zero mask (a forward and backward that add
    nothing to any loss, gradient or metric)."""
    batch = _full_batch(h.tiny_model()).select([0, 1])
    micro = split_micro(batch, MicroBatching(1, True, BUDGET), agree=lambda n: 4)
    assert micro == [[0], [1], [], []]
    placeholder = select_micro(batch, [])
    assert len(placeholder) == 1 and float(placeholder.mask_BT.sum()) == 0.0
    assert select_micro(batch, [1]).responses == [batch.responses[1]]
