"""PPO's clipped value loss (minirl.critic.value_loss) and the explained variance.

Properties a PPO value loss must have: ½·MSE when the clip is inactive; no gradient through the clipped
branch where it binds; the micro-batch split does not change the aggregated value or gradient
(the global normalisation of minirl.algo.loss_agg, as for the policy loss). Plus a float64 reference
of the whole formula and of the explained variance.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minirl.algo.loss_agg import LOSS_AGG_MODES, aggregate, mini_batch_norm
from minirl.critic.value_loss import EXPLAINED_VAR_EPS, clipped_value_loss, explained_variance

FAST = settings(max_examples=40, deadline=None)


@st.composite
def values(draw, B_max: int = 8, T_max: int = 6):
    """float64 vpred (a leaf), old values, returns [B, T] and a prefix mask; row 0 non-empty."""
    B, T = draw(st.integers(1, B_max)), draw(st.integers(1, T_max))
    lengths = draw(st.lists(st.integers(0, T), min_size=B, max_size=B))
    lengths[0] = max(lengths[0], 1)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    old = torch.randn(B, T, generator=g, dtype=torch.float64)
    vpred = (old + draw(st.floats(0.01, 2.0)) * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    returns = 2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).double()
    return vpred, old, returns, mask


def _token_mean(x_BT, mask_BT):
    return (x_BT * mask_BT).sum() / mask_BT.sum()


def _norm(mask_BT):
    return mini_batch_norm(mask_BT, lambda x: x, None, mask_BT.shape[1])


@FAST
@given(batch=values(), clip=st.floats(0.05, 3.0))
def test_matches_a_float64_reference(batch, clip):
    """Per token ½·max((V−R)², (V_old + clamp(V−V_old, ±c) − R)²), written out element by element."""
    vpred, old, returns, mask = batch
    out = clipped_value_loss(vpred.detach(), old, returns, mask, clip)
    for i, j in itertools.product(range(mask.shape[0]), range(mask.shape[1])):
        v, o, r = float(vpred.detach()[i, j]), float(old[i, j]), float(returns[i, j])
        vclip = o + min(max(v - o, -clip), clip)
        want = 0.5 * max((v - r) ** 2, (vclip - r) ** 2) * float(mask[i, j])
        assert float(out.loss_BT[i, j]) == pytest.approx(want, rel=1e-12, abs=1e-12)
        assert float(out.clipped_BT[i, j]) == float((vclip - r) ** 2 > (v - r) ** 2) * float(mask[i, j])


@FAST
@given(batch=values())
def test_inactive_clip_is_half_the_mean_squared_error(batch):
    """A clip range wider than every |V − V_old| leaves V_clip = V: the token-mean loss is ½·MSE
    over the valid tokens, its gradient (V − R)/N, and nothing counts as clipped."""
    vpred, old, returns, mask = batch
    clip = float((vpred.detach() - old).abs().max()) + 1.0
    out = clipped_value_loss(vpred, old, returns, mask, clip)
    loss = aggregate(out.loss_BT, mask, "token-mean", _norm(mask))
    mse = _token_mean((vpred.detach() - returns) ** 2, mask)
    assert float(loss.detach()) == pytest.approx(0.5 * float(mse), rel=1e-12)
    (grad,) = torch.autograd.grad(loss, vpred)
    torch.testing.assert_close(grad, (vpred.detach() - returns) * mask / mask.sum(), rtol=1e-12, atol=1e-15)
    assert float(out.clipped_BT.sum()) == 0.0


@FAST
@given(batch=values(), clip=st.floats(0.01, 0.5))
def test_no_gradient_where_the_clipped_branch_binds(batch, clip):
    """Where the clipped branch is strictly larger, V has left [V_old − c, V_old + c] and the loss
    there is ½(V_old ± c − R)², constant in V: the gradient is exactly 0. Elsewhere it is the
    unclipped (V − R)/N."""
    vpred, old, returns, mask = batch
    out = clipped_value_loss(vpred, old, returns, mask, clip)
    (grad,) = torch.autograd.grad(aggregate(out.loss_BT, mask, "token-mean", _norm(mask)), vpred)
    binds = out.clipped_BT.bool()
    assert bool(((vpred.detach() - old).abs()[binds] > clip).all())
    assert bool((grad[binds] == 0).all())
    free = ~binds & mask.bool()
    torch.testing.assert_close(grad[free], ((vpred.detach() - returns) / mask.sum())[free], rtol=1e-12, atol=1e-15)


def test_clipped_branch_binds_in_a_hand_example():
    """V_old = 0, c = 0.5, R = 1: V = −1 is clipped to −0.5, (−0.5 − 1)² = 2.25 < (−1 − 1)² = 4,
    so the unclipped branch wins; V = 2 (R = 0) clips to 0.5: 0.25 < 4, unclipped; V = 2 with
    R = 3 clips to 0.5: (0.5 − 3)² = 6.25 > 1, clipped and binds."""
    vpred = torch.tensor([[-1.0, 2.0, 2.0]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 3, dtype=torch.float64)
    returns = torch.tensor([[1.0, 0.0, 3.0]], dtype=torch.float64)
    out = clipped_value_loss(vpred, old, returns, torch.ones(1, 3), 0.5)
    torch.testing.assert_close(out.loss_BT, torch.tensor([[2.0, 2.0, 3.125]], dtype=torch.float64))
    assert out.clipped_BT.tolist() == [[0.0, 0.0, 1.0]]


@FAST
@given(batch=values(), mode=st.sampled_from(sorted(LOSS_AGG_MODES)), clip=st.floats(0.05, 1.0), data=st.data())
def test_micro_batch_split_does_not_change_value_or_gradient(batch, mode, clip, data):
    """Summing each micro-batch's aggregate() (divided by the global counts) over a random
    partition of the shuffled rows gives the whole batch's loss and gradient, for every mode."""
    vpred, old, returns, mask = batch
    whole = aggregate(clipped_value_loss(vpred, old, returns, mask, clip).loss_BT, mask, mode, _norm(mask))
    (want_grad,) = torch.autograd.grad(whole, vpred)
    rows = data.draw(st.permutations(range(mask.shape[0])))
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(rows) - 1)), max_size=len(rows) - 1)))
    parts = [rows[a:b] for a, b in zip([0, *cuts], [*cuts, len(rows)]) if rows[a:b]]
    norm = _norm(mask)
    total = sum(
        aggregate(clipped_value_loss(vpred[p], old[p], returns[p], mask[p], clip).loss_BT, mask[p], mode, norm)
        for p in parts
    )
    (got_grad,) = torch.autograd.grad(total, vpred)
    assert float(total.detach()) == pytest.approx(float(whole.detach()), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-12)


@FAST
@given(batch=values(), data=st.data())
def test_explained_variance_matches_numpy_style_reference_and_ranks_sum(batch, data):
    """1 − Var(R − V)/(Var(R) + 1e-5) over valid tokens (population variances); computed on two
    "ranks" whose sums the reducer adds, it equals the one-batch value."""
    _, values_BT, returns, mask = batch
    valid = mask.bool()
    r, d = returns[valid], (returns - values_BT)[valid]
    want = 1.0 - float(d.var(unbiased=False)) / (float(r.var(unbiased=False)) + EXPLAINED_VAR_EPS)
    assert explained_variance(returns, values_BT, mask, lambda x: x) == pytest.approx(want, rel=1e-9, abs=1e-9)
    split = data.draw(st.integers(0, mask.shape[0]))
    halves = [(returns[:split], values_BT[:split], mask[:split]), (returns[split:], values_BT[split:], mask[split:])]

    def reduce_two(x):  # the sum over the two "ranks" of the statistics each computes
        return sum(_stats(*h) for h in halves)

    got = explained_variance(returns[:0], values_BT[:0], mask[:0], reduce_two)
    assert got == pytest.approx(want, rel=1e-9, abs=1e-9)


def _stats(returns, values_BT, mask):
    """The five sums explained_variance reduces, of one rank's rows (records them via a reducer)."""
    seen = []
    explained_variance(returns, values_BT, mask, lambda x: seen.append(x) or x)
    return seen[0]


def test_perfect_values_explain_everything():
    returns = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    assert explained_variance(returns, returns.clone(), torch.ones(2, 2), lambda x: x) == pytest.approx(1.0)
