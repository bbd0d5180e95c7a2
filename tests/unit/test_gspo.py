"""GSPO (plugins/algorithms/policy_loss.py): the sequence-level ratio, its clip, and how it aggregates.

Checked against a scalar float64 restatement of the paper's objective, by value and gradient,
and for invariance of the global loss normalisation to the micro-batch split.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minirl.algo.loss_agg import LOSS_AGG_MODES, aggregate, mini_batch_norm
from minirl.config.schema import ActorConfig
from minirl_plugins.algorithms.policy_loss import GSPO_CLIP_HIGH, GSPO_CLIP_LOW, minirl_policy_losses

FAST = settings(max_examples=40, deadline=None)
GSPO = minirl_policy_losses()["gspo"]
CFG = ActorConfig(policy_loss="gspo")


@st.composite
def sequences(draw, max_shift: float = 0.01):
    """B sequences of prefix masks (row 0 non-empty), lp leaf, lp_old = lp − shift per token,
    and one outcome advantage per sequence broadcast over its tokens (a few exactly 0)."""
    B, T = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    lens = draw(st.lists(st.integers(0, T), min_size=B, max_size=B))
    lens[0] = max(lens[0], 1)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    mask = (torch.arange(T)[None, :] < torch.tensor(lens)[:, None]).double()
    logp = (-torch.rand(B, T, generator=gen, dtype=torch.float64) * 3) * mask
    shift = (torch.rand(B, T, generator=gen, dtype=torch.float64) * 2 - 1) * max_shift
    adv_B = torch.tensor(draw(st.lists(st.sampled_from([-1.5, -0.3, 0.0, 0.7, 2.0]), min_size=B, max_size=B)))
    return logp, (logp - shift) * mask, adv_B.double()[:, None] * mask, mask


def _reference(logp, old, adv, mask, eps_low, eps_high):
    """Per sequence, in Python floats: s_i = exp(mean_t(lp − lp_old)); loss_{i,t} = max(−A s_i,
    −A clip(s_i)); d loss_{i,t} / d lp_t = −A·s_i when the unclipped branch is taken, else 0."""
    loss, grad = torch.zeros_like(logp), torch.zeros_like(logp)
    for i in range(logp.shape[0]):
        n = int(mask[i].sum())
        if n == 0:
            continue
        s = math.exp(sum(logp[i, t].item() - old[i, t].item() for t in range(n)) / n)
        for t in range(n):
            a = adv[i, t].item()
            plain, clipped = -a * s, -a * min(max(s, 1 - eps_low), 1 + eps_high)
            loss[i, t] = max(plain, clipped)
            grad[i, t] = -a * s if plain >= clipped else 0.0
    return loss, grad


@FAST
@given(batch=sequences())
def test_ratio_one_is_reinforce_with_a_per_sequence_mean(batch):
    """lp == lp_old: s_i = 1 exactly, the per-token loss is −A (bit for bit), nothing is clipped,
    and under seq-mean-token-mean the gradient to each valid lp_t is −A_i / (|y_i| · #sequences)."""
    logp, _, adv, mask = batch
    logp.requires_grad_()
    out = GSPO(logp, logp.detach(), adv, mask, CFG)
    assert torch.equal(out.loss_BT, -adv * mask)
    assert torch.all(out.clipped_BT == 0) and torch.all(out.approx_kl_BT == 0)
    norm = mini_batch_norm(mask, lambda x: x, None, mask.shape[1])
    aggregate(out.loss_BT, mask, "seq-mean-token-mean", norm).backward()
    lens = mask.sum(-1, keepdim=True).clamp(min=1)
    torch.testing.assert_close(logp.grad, -adv * mask / (lens * norm.seqs), rtol=1e-12, atol=1e-15)


@FAST
@given(batch=sequences(max_shift=0.002), low=st.sampled_from([None, 0.0, 5e-4]), high=st.sampled_from([None, 1e-3]))
def test_value_and_gradient_match_the_sequence_objective(batch, low, high):
    """Against the scalar restatement: every token of a sequence has its sequence's loss, and the
    gradient of Σ loss is −A·s_i on each token of an unclipped sequence and exactly 0 on every
    token of a sequence whose clip binds (A > 0 and s_i > 1 + ε_high, or A < 0 and s_i < 1 − ε_low)."""
    logp, old, adv, mask = batch
    cfg = replace(CFG, clip_ratio_low=low, clip_ratio_high=high)
    eps_low = GSPO_CLIP_LOW if low is None else low
    eps_high = GSPO_CLIP_HIGH if high is None else high
    logp.requires_grad_()
    out = GSPO(logp, old, adv, mask, cfg)
    out.loss_BT.sum().backward()
    want_loss, want_grad = _reference(logp.detach(), old, adv, mask, eps_low, eps_high)
    torch.testing.assert_close(out.loss_BT.detach(), want_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logp.grad, want_grad, rtol=1e-12, atol=1e-12)
    bound = (want_grad == 0) & (adv != 0) & (mask > 0)
    assert torch.equal(out.clipped_BT.bool(), bound)


def test_clip_binds_and_the_sequence_gets_no_gradient():
    """Hand values with the default ε (3e-4 / 4e-4). Row 0: lp − lp_old = [0.001, 0.003], s =
    e^0.002 > 1.0004, A = 1 → loss −1.0004, clipped, gradient 0. Row 1: the same shift with A = −1
    → unclipped, loss e^0.002, gradient −A·s = e^0.002 on both tokens. Row 2: s = e^−0.001 <
    0.9997 with A = −1 → loss 0.9997, clipped, gradient 0."""
    logp = torch.zeros(3, 2, dtype=torch.float64, requires_grad=True)
    old = -torch.tensor([[0.001, 0.003], [0.001, 0.003], [-0.002, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    out = GSPO(logp, old, adv, torch.ones(3, 2, dtype=torch.float64), CFG)
    out.loss_BT.sum().backward()
    s = math.exp(0.002)
    want = torch.tensor([[-1.0004, -1.0004], [s, s], [0.9997, 0.9997]], dtype=torch.float64)
    torch.testing.assert_close(out.loss_BT.detach(), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0], [s, s], [0.0, 0.0]], dtype=torch.float64))
    assert out.clipped_BT.tolist() == [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]
    torch.testing.assert_close(out.approx_kl_BT, old)


def test_clip_ratio_is_not_gspo_s_and_set_bounds_apply():
    """actor.clip_ratio (PPO's 0.2) leaves GSPO at 3e-4 / 4e-4; clip_ratio_low / _high replace them."""
    logp, old = torch.log(torch.tensor([[1.1]])), torch.zeros(1, 1)
    args = (torch.ones(1, 1), torch.ones(1, 1))
    default = GSPO(logp, old, *args, replace(CFG, clip_ratio=0.2))
    torch.testing.assert_close(default.loss_BT, torch.tensor([[-(1 + GSPO_CLIP_HIGH)]]))
    wide = GSPO(logp, old, *args, replace(CFG, clip_ratio_high=0.05))
    torch.testing.assert_close(wide.loss_BT, torch.tensor([[-1.05]]))


def _split(draw, B: int) -> list[list[int]]:
    rows = draw(st.permutations(range(B)))
    cuts = sorted(draw(st.sets(st.integers(1, max(B - 1, 1)), max_size=max(B - 1, 0)))) if B > 1 else []
    bounds = [0, *cuts, B]
    return [rows[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


@FAST
@given(batch=sequences(max_shift=0.002), mode=st.sampled_from(sorted(LOSS_AGG_MODES)), data=st.data())
def test_any_micro_batch_split_gives_the_global_loss_and_gradient(batch, mode, data):
    """GSPO's sequence ratio lives inside one sequence, and a sequence never straddles micro-
    batches: the summed micro-batch contributions (each re-padded to its own width, normalised by
    the global counts) equal the whole batch's loss and gradient, in every aggregation mode."""
    logp, old, adv, mask = batch
    leaf = logp.clone().requires_grad_()
    norm = mini_batch_norm(mask, lambda x: x, None, mask.shape[1])
    whole = aggregate(GSPO(leaf, old, adv, mask, CFG).loss_BT, mask, mode, norm)
    whole.backward()
    split_leaf = logp.clone().requires_grad_()
    micro = []
    for rows in _split(data.draw, logp.shape[0]):
        width = max(int(mask[rows].sum(-1).max()), 1)
        micro.append([x[rows][:, :width] for x in (split_leaf, old, adv, mask)])
    total = sum(aggregate(GSPO(lp, o, a, m, CFG).loss_BT, m, mode, norm) for lp, o, a, m in micro)
    total.backward()
    torch.testing.assert_close(total.detach(), whole.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(split_leaf.grad, leaf.grad, rtol=1e-12, atol=1e-12)
