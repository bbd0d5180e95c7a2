"""The response mask with holes (issue 26, part 4): every consumer of the mask is right when a
multi-turn response holds tool and user tokens (mask 0) between the model's tokens (mask 1).

The central property: a trajectory with tool tokens gives exactly what the same model tokens give
with the tool tokens removed. Each test builds a holed batch (random interleavings of model and
tool segments, random per-token values everywhere, junk at tool positions included) and its
compacted twin (each row keeps only its mask-1 tokens, left-aligned, so its mask is contiguous),
runs the real function on both and compares at the model tokens: float64 to 1e-12 (a sum over a
row with zeros in between rounds in another order, so not always bit for bit), the float32 actor
loss to float32 precision. Tool positions must come out exactly 0, with exactly 0 gradient.
And a one-turn trajectory equals today's: the functions this change rewrote (place_scores, the
total-token count of the perf metrics) give bit-identical results on contiguous masks.

seq-mean-token-sum-norm divides by a constant (data.max_response_length, or actor.loss_scale_factor),
never by the padded width T, which differs between the two batches: both use MAX_RESPONSE_LENGTH.
Legend: B sequences, T response positions (C: of the compacted batch), N response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import minirl.update.actor as actor_lib
from minirl.algo.dynamic_sampling import informative_groups
from minirl.algo.kl_control import apply_kl_in_reward
from minirl.algo.loss_agg import LOSS_AGG_MODES, aggregate, mini_batch_norm
from minirl.algo.rollout_corr import MismatchStats, tis_weights
from minirl.algo.stats import DeviceSums, masked_mean, masked_var, masked_whiten
from minirl.batch import RolloutBatch, response_mask, trajectory_mask
from minirl.config.schema import ActorConfig, AlgorithmConfig
from minirl.critic.value_loss import clipped_value_loss, explained_variance
from minirl.dist.context import DistContext
from minirl.observe.step_metrics import data_metrics, perf_metrics
from minirl.protocols import AdvantageInputs, no_reduce
from minirl.reward.manager import place_scores
from minirl_plugins.algorithms.advantage import minirl_advantage_estimators
from minirl_plugins.algorithms.kl import minirl_kl_estimators
from minirl_plugins.algorithms.policy_loss import minirl_policy_losses

FAST = settings(max_examples=25, deadline=None)
CPU = torch.device("cpu")
DIST = DistContext(device=CPU)
MODES = sorted(LOSS_AGG_MODES)
MAX_RESPONSE_LENGTH = 64  # seq-mean-token-sum-norm's S, the same for both batches
POLICY_LOSSES = minirl_policy_losses()
KL = {k: fn for k, fn in minirl_kl_estimators().items() if not getattr(fn, "needs_logits", False)}
ESTIMATORS = minirl_advantage_estimators()
ALGO = AlgorithmConfig()
TOL = {"rtol": 1e-12, "atol": 1e-12}


def compact(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Each row's mask-1 values, left-aligned, zero-padded to the most model tokens of a row."""
    keep_BT = mask_BT.bool()
    counts = keep_BT.sum(-1).tolist()
    out_BC = x_BT.new_zeros(len(counts), max(1, max(counts, default=0)))
    for b, n in enumerate(counts):
        out_BC[b, :n] = x_BT[b][keep_BT[b]]
    return out_BC


@dataclass
class Twin:
    """One batch as tensors, each [B, T] float64: the mask, and per-token values by name (logp,
    old, ref, roll, adv, values, ent, rewards)."""

    mask: torch.Tensor
    x: dict[str, torch.Tensor]

    def at_model(self, y_BT: torch.Tensor) -> torch.Tensor:
        """y's values at the model tokens, row-major: the same order in a batch and its compaction."""
        return y_BT[self.mask.bool()]


@st.composite
def holed(draw, max_rows: int = 5):
    """(holed Twin, compacted Twin, masks): rows of random model/tool segments (some rows all
    tool tokens or empty; row 0 has a model token), random values at every position."""
    B = draw(st.integers(1, max_rows))
    masks = []
    for _ in range(B):
        segments = draw(st.lists(st.tuples(st.booleans(), st.integers(1, 4)), max_size=5))
        masks.append([int(model) for model, n in segments for _ in range(n)])
    masks[0] = masks[0] if 1 in masks[0] else masks[0] + [1]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    mask = trajectory_mask(masks, CPU).double()

    def rand(scale=1.0):
        return (torch.rand(mask.shape, generator=gen, dtype=torch.float64) * 2 - 1) * scale

    logp = -torch.rand(mask.shape, generator=gen, dtype=torch.float64) * 3
    old = logp + rand(0.3)
    x = {"logp": logp, "old": old, "ref": logp + rand(0.5), "roll": old + rand(0.3), "adv": rand(2.0)}
    x.update(values=rand(2.0), ent=rand(1.0).abs() * 2, rewards=rand(1.0))
    return Twin(mask, x), Twin(compact(mask, mask), {k: compact(v, mask) for k, v in x.items()}), masks


def _agg(loss_BT: torch.Tensor, t: Twin, mode: str) -> torch.Tensor:
    return aggregate(loss_BT, t.mask, mode, mini_batch_norm(t.mask, no_reduce, None, MAX_RESPONSE_LENGTH))


def _assert_twins(y_h: torch.Tensor, y_c: torch.Tensor, h: Twin, c: Twin, tol=TOL) -> None:
    """Equal at the model tokens, exactly 0 at every other position of the holed batch."""
    torch.testing.assert_close(h.at_model(y_h), c.at_model(y_c), **tol)
    assert bool((y_h[~h.mask.bool()] == 0).all())


@FAST
@given(holed())
def test_trajectory_mask_rows_and_single_turn_equal_response_mask(twins):
    """Row b is masks[b] then zeros; masks of all ones give response_mask bit for bit."""
    h, _, masks = twins
    for b, m in enumerate(masks):
        assert h.mask[b, : len(m)].tolist() == m and not h.mask[b, len(m) :].any()
    responses = [[7] * len(m) for m in masks]
    one_turn = trajectory_mask([[1] * len(r) for r in responses], CPU)
    assert one_turn.dtype == torch.float32 and torch.equal(one_turn, response_mask(responses, CPU))


@FAST
@given(holed())
def test_policy_loss_in_every_agg_mode_equals_the_compacted_loss(twins):
    """Every registered policy loss under every loss_agg_mode: value and gradient of the model
    tokens are the compacted batch's, the tool tokens get exactly 0 gradient, and the global
    counts are model tokens and sequences with a model token."""
    h, c, _ = twins
    assert mini_batch_norm(h.mask, no_reduce, None, 1) == mini_batch_norm(c.mask, no_reduce, None, 1)
    for name, fn in POLICY_LOSSES.items():
        cfg = ActorConfig(policy_loss=name, clip_ratio_low=0.2, clip_ratio_high=0.28)
        for mode in MODES:
            values, grads = [], []
            for t in (h, c):
                logp = t.x["logp"].clone().requires_grad_()
                out = fn(logp, t.x["old"], t.x["adv"], t.mask, cfg)
                value = _agg(out.loss_BT, t, mode)
                value.backward()
                metrics = [_agg(m, t, "token-mean") for m in (out.clipped_BT, out.approx_kl_BT, out.clipped_lower_BT)]
                values.append(torch.stack([value.detach(), *metrics]))
                grads.append(logp.grad)
            torch.testing.assert_close(values[0], values[1], **TOL)
            _assert_twins(grads[0], grads[1], h, c)


@FAST
@given(holed())
def test_kl_loss_and_entropy_equal_the_compacted_ones(twins):
    """KL loss (every estimator that needs no logits) and the entropy term, in every mode."""
    h, c, _ = twins
    for mode in MODES:
        for est in KL.values():
            values, grads = [], []
            for t in (h, c):
                logp = t.x["logp"].clone().requires_grad_()
                value = _agg(est(logp, t.x["ref"]), t, mode)
                value.backward()
                values.append(value.detach())
                grads.append(logp.grad)
            torch.testing.assert_close(values[0], values[1], **TOL)
            _assert_twins(grads[0], grads[1], h, c)
        torch.testing.assert_close(_agg(h.x["ent"], h, mode), _agg(c.x["ent"], c, mode), **TOL)


def _rollout_batch(t: Twin, lens: list[int], on_policy: bool) -> RolloutBatch:
    """The Twin as the actor's update sees it (responses of `lens` tokens), float32 as the
    trainer keeps it."""
    f32 = {k: v.float() for k, v in t.x.items()}
    return RolloutBatch(
        prompts=[[1, 2, 3]] * len(lens),
        responses=[[5] * n for n in lens],
        group_B=torch.zeros(len(lens), dtype=torch.long),
        mask_BT=t.mask.float(),
        rollout_log_probs_BT=f32["roll"],
        old_log_probs_BT=None if on_policy else f32["old"],
        ref_log_probs_BT=f32["ref"],
        advantages_BT=f32["adv"],
    )


def _actor_loss(t: Twin, lens: list[int], job: actor_lib.ActorUpdate):
    """minirl.update.actor's micro-batch loss of the whole batch, its forward replaced by the
    Twin's log-probs and entropies at the responses' tokens (unpadded, as the forward returns
    them). Returns the loss, the metric sums and mismatch metrics, and the forward's gradient
    at model tokens and at other tokens."""
    lengths_BT = response_mask([[0] * n for n in lens], CPU).bool()
    leaf_N2 = torch.stack([t.x["logp"], t.x["ent"]], -1)[lengths_BT].clone().requires_grad_()
    model_N = t.mask[lengths_BT].bool()
    mb = _rollout_batch(t, lens, job.on_policy)
    sums, mismatch = DeviceSums(), MismatchStats(CPU) if job.on_policy else None
    norm = mini_batch_norm(mb.mask_BT, no_reduce, None, MAX_RESPONSE_LENGTH)
    with mock.patch.object(actor_lib, "response_logprobs", lambda *args, **kwargs: leaf_N2.unbind(-1)):
        loss = actor_lib._micro_batch_loss(job, mismatch, DIST, mb, norm, sums)
    loss.backward()
    metrics = {**sums.means(1, ""), **(mismatch.reduced(DIST) if mismatch else {})}
    return float(loss.detach()), metrics, leaf_N2.grad[model_N], leaf_N2.grad[~model_N]


@FAST
@given(holed(), st.sampled_from(MODES), st.sampled_from(sorted(POLICY_LOSSES)), st.booleans())
def test_actor_micro_batch_loss_equals_the_compacted_loss(twins, mode, policy_loss, on_policy):
    """The actor's whole micro-batch loss (policy loss with TIS, entropy bonus, KL loss) and its
    metrics (on-policy: the rollout mismatch too), through minirl.update.actor with the forward
    replaced by fixed per-token values: the holed batch's equal the compacted batch's (float32,
    as the trainer computes them), and tool tokens get exactly 0 gradient."""
    h, c, masks = twins
    cfg = ActorConfig(policy_loss=policy_loss, loss_agg_mode=mode, entropy_coeff=0.01, use_kl_loss=True)
    cfg = replace(cfg, kl_loss_coef=0.1, tis_imp_ratio_cap=1.5, clip_ratio_low=0.2, clip_ratio_high=0.2)
    losses = actor_lib.Losses(POLICY_LOSSES[policy_loss], KL["low_var_kl"])
    job = actor_lib.ActorUpdate(SimpleNamespace(model=None), cfg, losses, 1.0, on_policy)  # the forward is patched
    loss_h, metrics_h, grad_h, tool_grad = _actor_loss(h, [len(m) for m in masks], job)
    loss_c, metrics_c, grad_c, _ = _actor_loss(c, [int(n) for n in c.mask.sum(-1).tolist()], job)
    assert loss_h == pytest.approx(loss_c, rel=1e-5, abs=1e-6)
    assert metrics_h.keys() == metrics_c.keys() and "tis_weight_mean" in metrics_h
    for k in metrics_h:
        assert metrics_h[k] == pytest.approx(metrics_c[k], rel=1e-5, abs=1e-6), k
    torch.testing.assert_close(grad_h, grad_c, rtol=1e-5, atol=1e-6)
    assert bool((tool_grad == 0).all())


@FAST
@given(holed(), st.sampled_from(sorted(KL)), st.floats(0.0, 2.0))
def test_kl_in_reward_equals_the_compacted_one(twins, kl_penalty, beta):
    """Per-token rewards, their per-sequence sums and the controller's mean KL: the compacted
    batch's; tool positions carry no reward."""
    h, c, _ = twins
    scores_B = h.x["rewards"][:, 0].float()
    out = []
    for t in (h, c):
        token_scores_BT = place_scores(scores_B, t.mask).double()
        rewards_BT, mean_kl = apply_kl_in_reward(token_scores_BT, t.x["old"], t.x["ref"], t.mask, beta, KL[kl_penalty])
        out.append((rewards_BT, mean_kl))
    _assert_twins(out[0][0], out[1][0], h, c)
    torch.testing.assert_close(out[0][0].sum(-1), out[1][0].sum(-1), **TOL)
    assert out[0][1] == pytest.approx(out[1][1], rel=1e-12, abs=1e-12)


OUTCOME = {
    "grpo": ALGO,
    "dr_grpo": replace(ALGO, norm_adv_by_std_in_grpo=False),
    "rloo": ALGO,
    "opo": ALGO,
    "reinforce_plus_plus_baseline": ALGO,
}


@FAST
@given(holed(max_rows=8), st.data())
def test_outcome_estimators_equal_the_compacted_ones(twins, data):
    """grpo (and Dr.GRPO), rloo, opo (length weights count model tokens) and
    reinforce_plus_plus_baseline (whitened over model tokens): advantages and returns at model
    tokens are the compacted batch's, 0 at tool tokens, and rewards at tool positions are never read."""
    h, c, _ = twins
    B = h.mask.shape[0]
    group_B = torch.tensor(data.draw(st.lists(st.integers(0, 2), min_size=B, max_size=B)))
    scores_B = torch.tensor(data.draw(st.lists(st.sampled_from([-1.0, 0.0, 0.5, 1.0]), min_size=B, max_size=B)))
    junk_BT = h.x["rewards"] * (1 - h.mask)  # at tool positions and padding
    rewards_h = place_scores(scores_B, h.mask).double() + junk_BT
    rewards_c = place_scores(scores_B, c.mask).double()
    for name, cfg in OUTCOME.items():
        estimator = ESTIMATORS[name.removeprefix("dr_")]
        adv_h, ret_h = estimator(AdvantageInputs(rewards_h, h.mask, group_B), cfg)
        adv_c, ret_c = estimator(AdvantageInputs(rewards_c, c.mask, group_B), cfg)
        _assert_twins(adv_h, adv_c, h, c)
        _assert_twins(ret_h, ret_c, h, c)


@FAST
@given(holed(), st.floats(0.5, 1.0), st.floats(0.5, 1.0))
def test_token_level_estimators_skip_tool_tokens(twins, gamma, lam):
    """reinforce_plus_plus and gae with a reward on every model token: γ (and λ) apply per model
    token, the return, the advantage and V_next pass tool tokens unchanged, so the results are
    the compacted batch's; rewards and values at tool positions have no effect at all (two draws
    of them give bit-identical outputs)."""
    h, c, _ = twins
    cfg = replace(ALGO, gamma=gamma, lam=lam)
    tool_BT = 1 - h.mask
    for name in ("reinforce_plus_plus", "gae"):
        outs = []
        for junk in (1.0, -3.0):
            rewards_BT = h.x["rewards"] * h.mask + junk * tool_BT * h.x["adv"]
            values_BT = h.x["values"] * h.mask + junk * tool_BT * h.x["ent"]
            outs.append(ESTIMATORS[name](AdvantageInputs(rewards_BT, h.mask, torch.zeros(1), values_BT), cfg))
        assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[1]))
        compacted = ESTIMATORS[name](AdvantageInputs(c.x["rewards"], c.mask, torch.zeros(1), c.x["values"]), cfg)
        for y_h, y_c in zip(outs[0], compacted):
            _assert_twins(y_h, y_c, h, c)


@FAST
@given(holed(max_rows=8))
def test_masked_statistics_and_whitening_count_model_tokens_only(twins):
    """masked_mean, masked_var and masked_whiten (the advantage whitening) over model tokens
    only: the compacted batch's (exactness over ranks is tests/unit/test_stats.py's)."""
    h, c, _ = twins
    x_h, x_c = h.x["adv"], c.x["adv"]
    torch.testing.assert_close(masked_mean(x_h, h.mask), masked_mean(x_c, c.mask), **TOL)
    torch.testing.assert_close(masked_var(x_h, h.mask), masked_var(x_c, c.mask), **TOL)
    _assert_twins(masked_whiten(x_h, h.mask), masked_whiten(x_c, c.mask), h, c)
    _assert_twins(masked_whiten(x_h, h.mask, shift_mean=False), masked_whiten(x_c, c.mask, shift_mean=False), h, c)


@FAST
@given(holed(), st.sampled_from(MODES), st.floats(1.01, 3.0))
def test_rollout_correction_weights_and_metrics_equal_the_compacted_ones(twins, mode, cap):
    """TIS: the weighted policy loss, the mean weight and the capped share (minirl has only
    token-level weights: no sequence-level ratio to take over tool tokens), and the mismatch
    metrics rollout_corr/*: all the compacted batch's."""
    h, c, _ = twins
    out = []
    for t in (h, c):
        w_BT = tis_weights(t.x["old"], t.x["roll"], cap)
        pg = POLICY_LOSSES["vanilla"](t.x["logp"], t.x["old"], t.x["adv"], t.mask, ActorConfig())
        stats = MismatchStats(CPU)
        stats.add(t.x["old"], t.x["roll"], t.mask)
        weighted = torch.stack([_agg(pg.loss_BT * w_BT, t, mode), _agg(w_BT, t, "token-mean")])
        out.append((torch.cat([weighted, _agg((w_BT >= cap).double(), t, "token-mean")[None]]), stats.reduced(DIST)))
    torch.testing.assert_close(out[0][0], out[1][0], **TOL)
    assert out[0][1] == pytest.approx(out[1][1], rel=1e-12, abs=1e-12)


def _old_place_scores(scores_B, lengths_B, T: int) -> torch.Tensor:
    """place_scores before masks with holes (score at index length - 1), kept to prove that
    single-turn scores sit where they did, bit for bit."""
    scores_B = torch.as_tensor(scores_B, dtype=torch.float32)
    lengths_B = torch.as_tensor(lengths_B, dtype=torch.long)
    token_scores_BT = torch.zeros(len(scores_B), T, dtype=torch.float32)
    placed_B = torch.where(lengths_B > 0, scores_B, torch.zeros_like(scores_B))
    token_scores_BT[torch.arange(len(scores_B)), (lengths_B - 1).clamp(min=0)] = placed_B
    return token_scores_BT


@FAST
@given(holed(max_rows=8), st.data())
def test_place_scores_lands_on_the_last_model_token(twins, data):
    """The score sits on the last 1 of the mask (not at length - 1: a response may end in tool
    tokens), a row without a model token stays all zero; the compacted batch's scores are the
    same at the same tokens; dynamic sampling's group metrics agree; and with contiguous masks
    the scores are the old formula's, bit for bit."""
    h, c, masks = twins
    B = len(masks)
    scores_B = torch.tensor(data.draw(st.lists(st.sampled_from([-1.0, 0.0, 0.5, 1.0]), min_size=B, max_size=B)))
    placed_h, placed_c = place_scores(scores_B, h.mask), place_scores(scores_B, c.mask)
    for b, m in enumerate(masks):
        where = [t for t, v in enumerate(m) if v][-1:]  # the last model token, if any
        expected = torch.zeros(h.mask.shape[1])
        expected[where] = scores_B[b] if where else 0.0
        assert torch.equal(placed_h[b], expected)
    _assert_twins(placed_h.double(), placed_c.double(), h, c, tol={"rtol": 0, "atol": 0})
    n = data.draw(st.sampled_from([d for d in (1, 2, 4, 8) if B % d == 0]))
    batch = SimpleNamespace(scores_B=scores_B, token_scores_BT=placed_h)
    for metric in ("score", "seq_reward"):
        compacted = SimpleNamespace(scores_B=scores_B, token_scores_BT=placed_c)
        assert torch.equal(informative_groups(batch, metric, n), informative_groups(compacted, metric, n))
    lens = [len(m) for m in masks]
    one_turn = response_mask([[0] * k for k in lens], CPU)
    assert torch.equal(place_scores(scores_B, one_turn), _old_place_scores(scores_B, lens, one_turn.shape[1]))


@FAST
@given(holed(), st.sampled_from(MODES), st.floats(0.05, 1.0))
def test_value_loss_and_explained_variance_equal_the_compacted_ones(twins, mode, clip):
    """The critic's clipped value loss in every mode (value, and 0 gradient at tool tokens) and
    the explained variance, over model tokens only."""
    h, c, _ = twins
    values, grads = [], []
    for t in (h, c):
        vpred = (t.x["values"] + t.x["ent"] - 1).clone().requires_grad_()
        loss = _agg(clipped_value_loss(vpred, t.x["values"], t.x["rewards"], t.mask, clip).loss_BT, t, mode)
        loss.backward()
        explained = explained_variance(t.x["rewards"], vpred.detach(), t.mask, no_reduce)
        values.append(torch.tensor([float(loss.detach()), explained], dtype=torch.float64))
        grads.append(vpred.grad)
    torch.testing.assert_close(values[0], values[1], **TOL)
    _assert_twins(grads[0], grads[1], h, c)


def _metrics_batch(t: Twin, lens: list[int], scores_B: torch.Tensor) -> RolloutBatch:
    """A batch for the step metrics: the Twin's values as rewards, advantages and returns."""
    f32 = {k: v.float() for k, v in t.x.items()}
    return RolloutBatch(
        prompts=[[1] * (2 + b % 3) for b in range(len(lens))],
        responses=[[5] * n for n in lens],
        group_B=torch.arange(len(lens)) // 2,
        mask_BT=t.mask.float(),
        finish_reasons=["stop", "length"] * (len(lens) // 2) + ["stop"] * (len(lens) % 2),
        scores_B=scores_B,
        rewards_BT=f32["rewards"] * t.mask.float(),
        advantages_BT=f32["adv"],
        returns_BT=f32["values"],
    )


@FAST
@given(holed(max_rows=8))
def test_step_metrics_count_model_tokens_and_report_tool_tokens(twins):
    """response_length and the data metrics count model tokens (the compacted batch's numbers);
    response/model_token_share and response_length/with_tool_tokens/mean count the tool tokens;
    the forward throughputs count every token, and single-turn they are the old formula's."""
    h, c, masks = twins
    lens, model_lens = [len(m) for m in masks], [int(n) for n in c.mask.sum(-1).tolist()]
    scores_B = h.x["rewards"][:, 0].float()
    holed_batch, compacted = _metrics_batch(h, lens, scores_B), _metrics_batch(c, model_lens, scores_B)
    got, want = data_metrics(holed_batch, DIST), data_metrics(compacted, DIST)
    assert got.keys() == want.keys()
    for k in got.keys() - {"response/model_token_share", "response_length/with_tool_tokens/mean"}:
        assert got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-6), k
    assert got["response/model_token_share"] == pytest.approx(sum(model_lens) / max(1, sum(lens)), rel=1e-12)
    assert got["response_length/with_tool_tokens/mean"] == pytest.approx(sum(lens) / len(lens), rel=1e-12)
    assert want["response/model_token_share"] == (1.0 if sum(model_lens) else 0.0)
    assert want["response_length/with_tool_tokens/mean"] == want["response_length/mean"]
    cfg = SimpleNamespace(trainer=SimpleNamespace(peak_flops=0.0))  # no peak on the CPU: no MFU
    perf = perf_metrics(holed_batch, {"gen": 1.0, "step": 2.0}, None, cfg, DIST)
    prompt_tokens = sum(2 + b % 3 for b in range(len(lens)))
    assert perf["perf/total_response_tokens"] == sum(model_lens)
    assert perf["perf/total_tokens"] == prompt_tokens + sum(lens)
    one_turn = replace(compacted, mask_BT=response_mask([[0] * n for n in model_lens], CPU))
    old_total = float(one_turn.mask_BT.sum()) + sum(len(p) for p in one_turn.prompts)  # the formula it replaced
    assert perf_metrics(one_turn, {"gen": 1.0, "step": 2.0}, None, cfg, DIST)["perf/total_tokens"] == old_total
