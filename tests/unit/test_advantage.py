"""Advantage estimators (docs/algorithms.md §2): the listed properties, loop references, golden values."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minirl.config.schema import AlgorithmConfig
from minirl.protocols import AdvantageInputs
from minirl_plugins.algorithms.advantage import minirl_advantage_estimators, reverse_linear_scan

FAST = settings(max_examples=30, deadline=None)
ESTIMATORS = minirl_advantage_estimators()
OUTCOME = ["grpo", "rloo", "opo", "reinforce_plus_plus_baseline"]
CFG = AlgorithmConfig()
DR_GRPO = replace(CFG, norm_adv_by_std_in_grpo=False)


def _run(name: str, inputs: AdvantageInputs, cfg: AlgorithmConfig = CFG):
    return ESTIMATORS[name](inputs, cfg)


def _inputs(scores, lengths, uids, T=None, values=None, holes=None) -> AdvantageInputs:
    """Score on the last valid token of each row (prefix masks, optional holes), float64."""
    T = T or max(max(lengths), 1)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).double()
    if holes is not None:
        mask = mask * holes
    rewards = torch.zeros(len(scores), T, dtype=torch.float64)
    for i, s in enumerate(scores):
        valid = mask[i].nonzero()
        if len(valid):
            rewards[i, int(valid[-1])] = s
    v = None if values is None else torch.as_tensor(values, dtype=torch.float64)
    return AdvantageInputs(rewards, mask, torch.as_tensor(uids, dtype=torch.int64), v)


@st.composite
def grouped_batches(draw, min_group=1, min_len=1, int_scores=True):
    """Interleaved groups with arbitrary (non-positional) uids; returns the inputs and, per
    row, its group number 0..G−1 (for tests that change one group)."""
    sizes = draw(st.lists(st.integers(min_group, 5), min_size=1, max_size=5))
    uid_values = draw(st.lists(st.integers(-(10**6), 10**6), min_size=len(sizes), max_size=len(sizes), unique=True))
    member = [g for g, n in enumerate(sizes) for _ in range(n)]
    member = draw(st.permutations(member))
    B, T = len(member), draw(st.integers(1, 6))
    score = st.integers(-3, 3).map(float) if int_scores else st.floats(-1e3, 1e3, allow_nan=False)
    scores = draw(st.lists(score, min_size=B, max_size=B))
    lengths = draw(st.lists(st.integers(min(min_len, T), T), min_size=B, max_size=B))
    values = draw(st.lists(st.lists(st.floats(-2, 2), min_size=T, max_size=T), min_size=B, max_size=B))
    return _inputs(scores, lengths, [uid_values[g] for g in member], T, values), member


# ---------------------------------------------------------------------------------------------
# properties (docs/algorithms.md §2, "Properties every estimator must satisfy")
# ---------------------------------------------------------------------------------------------


@FAST
@given(batch=grouped_batches(min_len=0), name=st.sampled_from(sorted(ESTIMATORS)), dr=st.booleans())
def test_masked_positions_stay_zero(batch, name, dr):
    """No estimator may leak advantage or return into masked positions (they would be trained on
    if a later mask were forgotten), including empty rows."""
    inputs, _ = batch
    adv, ret = _run(name, inputs, DR_GRPO if dr else CFG)
    assert torch.all(adv[inputs.mask_BT == 0] == 0) and torch.all(ret[inputs.mask_BT == 0] == 0)


@FAST
@given(batch=grouped_batches(min_group=2), name=st.sampled_from(OUTCOME), dr=st.booleans(), data=st.data())
def test_outcome_estimators_are_invariant_to_a_constant_added_to_a_group(batch, name, dr, data):
    """Adding c_g to every score of group g leaves the outcome advantages unchanged (groups of two
    or more: a group of one has no baseline, by the table's own rule)."""
    inputs, member = batch
    shifts = data.draw(st.lists(st.floats(-50, 50), min_size=max(member) + 1, max_size=max(member) + 1))
    shifted = _add_to_scores(inputs, torch.tensor([shifts[g] for g in member], dtype=torch.float64))
    cfg = DR_GRPO if dr else CFG
    torch.testing.assert_close(_run(name, shifted, cfg)[0], _run(name, inputs, cfg)[0], rtol=1e-6, atol=1e-6)


def _add_to_scores(inputs: AdvantageInputs, delta_B: torch.Tensor, scale_B: torch.Tensor | None = None):
    """Change every score (on the last valid token) to scale·s + delta."""
    rewards = inputs.token_rewards_BT.clone()
    if scale_B is not None:
        rewards = rewards * scale_B[:, None]
    last = (inputs.mask_BT * torch.arange(1, inputs.mask_BT.shape[1] + 1)).argmax(-1)
    rewards[torch.arange(len(last)), last] += delta_B * (inputs.mask_BT.sum(-1) > 0)
    return replace(inputs, token_rewards_BT=rewards)


@FAST
@given(batch=grouped_batches(), data=st.data())
def test_grpo_is_invariant_to_positive_scaling_of_a_group(batch, data):
    """Multiplying a group's scores by a > 0 leaves grpo's advantages unchanged (up to the 1e-6
    in the denominator, hence integer scores whose std is 0 or >= 0.4, and a in [0.5, 20])."""
    inputs, member = batch
    scales = data.draw(st.lists(st.floats(0.5, 20), min_size=max(member) + 1, max_size=max(member) + 1))
    scale_B = torch.tensor([scales[g] for g in member], dtype=torch.float64)
    single = torch.bincount(torch.tensor(member))[torch.tensor(member)] == 1
    scaled = _add_to_scores(inputs, torch.zeros_like(scale_B), scale_B)
    adv, ref = _run("grpo", scaled)[0], _run("grpo", inputs)[0]
    keep = ~single  # a group of one is s/(1+1e-6): it scales with its score, by the table's rule
    torch.testing.assert_close(adv[keep], ref[keep], rtol=1e-4, atol=1e-4)


@FAST
@given(
    batch=grouped_batches(min_len=0, int_scores=False),
    name=st.sampled_from(sorted(ESTIMATORS)),
    dr=st.booleans(),
)
def test_all_finite_for_groups_of_one_and_equal_scores(batch, name, dr):
    """Finite output for any finite input, in particular groups of one, groups of equal scores
    (std 0) and empty rows; and a group of >= 2 equal scores gives exactly 0."""
    inputs, member = batch
    zero = replace(inputs, token_rewards_BT=torch.zeros_like(inputs.token_rewards_BT))
    # 0.1 is not a binary fraction: mean(0.1, 0.1, 0.1) != 0.1 in floating point.
    equal = _add_to_scores(zero, torch.full((len(member),), 0.1, dtype=torch.float64))
    cfg = DR_GRPO if dr else CFG
    for case in (inputs, equal):
        adv, ret = _run(name, case, cfg)
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    if name in ("grpo", "rloo", "opo"):
        adv, _ = _run(name, equal, cfg)
        members = torch.tensor(member)
        non_empty = equal.mask_BT.sum(-1) > 0
        multi = torch.bincount(members)[members] > 1
        # exactly 0 for a group of >= 2 equal scores (empty rows score 0, not 0.1: skip those groups)
        all_equal = torch.tensor([bool(non_empty[members == g].all()) for g in member])
        assert torch.all(adv[multi & all_equal] == 0)


@FAST
@given(batch=grouped_batches(min_len=0), name=st.sampled_from(sorted(ESTIMATORS)), data=st.data())
def test_group_membership_comes_from_uid_not_batch_position(batch, name, data):
    """Permuting the rows (with their uids) permutes the outputs: an estimator that used batch
    position (contiguous blocks of n) would fail on these interleaved groups."""
    inputs, _ = batch
    perm = torch.tensor(data.draw(st.permutations(range(len(inputs.group_B)))))
    permuted = AdvantageInputs(
        inputs.token_rewards_BT[perm], inputs.mask_BT[perm], inputs.group_B[perm], inputs.values_BT[perm]
    )
    for got, ref in zip(_run(name, permuted), _run(name, inputs), strict=True):
        torch.testing.assert_close(got, ref[perm], rtol=1e-9, atol=1e-9)


@FAST
@given(batch=grouped_batches(min_len=0), gamma=st.floats(0.5, 1.0), lam=st.floats(0.0, 1.0), data=st.data())
def test_token_level_estimators_match_loop_references_with_holes(batch, gamma, lam, data):
    """reinforce_plus_plus and gae (parallel scans) must equal the straightforward reverse loops
    over valid tokens, also when the mask has holes (tool outputs), which are skipped."""
    inputs, _ = batch
    holes = torch.tensor(
        data.draw(st.lists(st.booleans(), min_size=inputs.mask_BT.numel(), max_size=inputs.mask_BT.numel()))
    )
    mask = inputs.mask_BT * holes.view_as(inputs.mask_BT).double()
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    dense = torch.rand(mask.shape, generator=gen, dtype=torch.float64)  # rewards on every token
    inputs = replace(inputs, mask_BT=mask, token_rewards_BT=inputs.token_rewards_BT + dense)
    cfg = replace(CFG, gamma=gamma, lam=lam)
    ref_ret, ref_adv, ref_gae_ret = _loop_references(inputs, gamma, lam)
    adv, ret = _run("reinforce_plus_plus", inputs, cfg)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(adv, _np_whiten(ref_ret, mask), rtol=1e-6, atol=1e-6)
    adv, ret = _run("gae", inputs, cfg)
    torch.testing.assert_close(ret, ref_gae_ret, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(adv, _np_whiten(ref_adv, mask), rtol=1e-6, atol=1e-6)


def _loop_references(inputs: AdvantageInputs, gamma: float, lam: float):
    r, m, v = inputs.token_rewards_BT, inputs.mask_BT, inputs.values_BT
    returns, gae_adv, gae_ret = (torch.zeros_like(r) for _ in range(3))
    for i in range(r.shape[0]):
        g, a, next_v = 0.0, 0.0, 0.0
        for t in reversed(m[i].nonzero().flatten().tolist()):
            g = r[i, t].item() + gamma * g
            a = r[i, t].item() + gamma * next_v - v[i, t].item() + gamma * lam * a
            returns[i, t], gae_adv[i, t], gae_ret[i, t] = g, a, a + v[i, t].item()
            next_v = v[i, t].item()
    return returns, gae_adv, gae_ret


def _np_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    valid = x.numpy()[mask.numpy() > 0]
    if valid.size < 2:
        return torch.zeros_like(x)
    out = (x.numpy() - valid.mean()) / np.sqrt(valid.var(ddof=1) + 1e-8)
    return torch.from_numpy(out) * mask


@FAST
@given(T=st.integers(1, 70), seed=st.integers(0, 2**31 - 1))
def test_reverse_linear_scan_matches_sequential_recursion(T, seed):
    """The log-depth scan must equal x[t] = b[t] + a[t]·x[t+1] for every length (powers of two
    and not), including a = 0 (resets) and a = 1 (carries)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.rand(3, T, generator=gen, dtype=torch.float64)
    a[a < 0.2], a[a > 0.8] = 0.0, 1.0
    b = torch.randn(3, T, generator=gen, dtype=torch.float64)
    ref, nxt = torch.zeros_like(b), torch.zeros(3, dtype=torch.float64)
    for t in reversed(range(T)):
        nxt = b[:, t] + a[:, t] * nxt
        ref[:, t] = nxt
    torch.testing.assert_close(reverse_linear_scan(a, b), ref, rtol=1e-12, atol=1e-12)


def test_whitening_estimators_are_exact_across_two_ranks():
    """reinforce_plus_plus(_baseline) and gae must pass inputs.reduce to the whitening: two
    simulated ranks holding whole groups get the advantages of the concatenated batch."""
    from test_stats import run_ranks

    full = _inputs([1, 0, 2, 5, 5, 3], [2, 3, 1, 3, 2, 1], [4, 4, 9, 9, 7, 7], 3, torch.rand(6, 3))
    for name in ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"):
        parts = [slice(0, 2), slice(2, 6)]
        fns = [lambda red, s=s, name=name: _run(name, _rows(full, s, red))[0] for s in parts]
        torch.testing.assert_close(torch.cat(run_ranks(fns)), _run(name, full)[0], rtol=1e-10, atol=1e-10)


def _rows(inputs: AdvantageInputs, rows: slice, reduce) -> AdvantageInputs:
    return AdvantageInputs(
        inputs.token_rewards_BT[rows],
        inputs.mask_BT[rows],
        inputs.group_B[rows],
        inputs.values_BT[rows],
        reduce,
    )


# ---------------------------------------------------------------------------------------------
# golden values (hand-computed)
# ---------------------------------------------------------------------------------------------


def test_golden_grpo_and_dr_grpo():
    """Group scores [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(1/3) = 0.57735, so grpo gives
    ±0.5/0.57735 = ±0.866025 (minus the 1e-6); Dr.GRPO gives ±0.5. Broadcast over valid tokens."""
    inputs = _inputs([1, 0, 0, 1], [2, 1, 2, 2], [3, 3, 3, 3], 2)
    adv, ret = _run("grpo", inputs)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    torch.testing.assert_close(adv, torch.tensor([[a, a], [-a, 0], [-a, -a], [a, a]], dtype=torch.float64))
    assert torch.equal(adv, ret)
    adv, _ = _run("grpo", inputs, DR_GRPO)
    assert adv[:, 0].tolist() == [0.5, -0.5, -0.5, 0.5]


def test_golden_interleaved_groups_and_group_of_one():
    """uids [5, 9, 5, 9, 2]: group 5 = scores {1, 0}: ±0.5/(std 0.70711 + 1e-6) = ±0.70711;
    group 9 = {3, 5}: ∓1/(1.41421 + 1e-6) = ∓0.70711; group 2 = {4} alone: mean 0, std 1, so
    4/(1 + 1e-6). rloo = n/(n−1)·(s − mean): group 5 → ±1, group 9 → ∓2, group of one → 4."""
    inputs = _inputs([1, 3, 0, 5, 4], [1] * 5, [5, 9, 5, 9, 2])
    a, b = 0.5 / (math.sqrt(0.5) + 1e-6), 1 / (math.sqrt(2) + 1e-6)
    expected = torch.tensor([a, -b, -a, b, 4 / (1 + 1e-6)], dtype=torch.float64)
    torch.testing.assert_close(_run("grpo", inputs)[0][:, 0], expected)
    assert _run("rloo", inputs)[0][:, 0].tolist() == [1.0, -2.0, -1.0, 2.0, 4.0]


def test_golden_rloo_leave_one_out():
    """Scores [1, 0, 0, 1]: s_i minus the mean of the other three: 1 − 1/3 = 2/3, 0 − 2/3."""
    adv, _ = _run("rloo", _inputs([1, 0, 0, 1], [1] * 4, [0] * 4))
    torch.testing.assert_close(adv[:, 0], torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3], dtype=torch.float64))


def test_golden_opo_length_weighted_baseline_and_group_of_one():
    """OPO: scores [1, 0] with lengths [2, 4]: b = (2·1 + 4·0)/6 = 1/3, A = [2/3, −1/3]. The
    documented choice for a group of one: baseline 0, A = s (here 0.7)."""
    adv, _ = _run("opo", _inputs([1, 0, 0.7], [2, 4, 3], [1, 1, 8], 4))
    torch.testing.assert_close(adv[:, 0], torch.tensor([2 / 3, -1 / 3, 0.7], dtype=torch.float64))
    torch.testing.assert_close(adv[1], torch.full((4,), -1 / 3, dtype=torch.float64))


def test_golden_reinforce_plus_plus_baseline():
    """Scores [1, 0] in one group, lengths [1, 3]: a = [0.5, −0.5] tiled over 4 valid tokens
    [0.5, −0.5, −0.5, −0.5]: mean −0.25, unbiased var (0.5625 + 3·0.0625)/3 = 0.25, std 0.5:
    whitened [1.5, −0.5, −0.5, −0.5] (up to the 1e-8)."""
    adv, _ = _run("reinforce_plus_plus_baseline", _inputs([1, 0], [1, 3], [0, 0], 3))
    expected = torch.tensor([[1.5, 0, 0], [-0.5, -0.5, -0.5]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected, rtol=1e-6, atol=1e-6)


def test_golden_reinforce_plus_plus_discounting():
    """γ = 0.5, reward 1 at the last of 3 tokens: G = [0.25, 0.5, 1]; whitened with mean 0.58333
    and unbiased std 0.381881: [−0.87287, −0.21822, 1.09109]."""
    adv, ret = _run("reinforce_plus_plus", _inputs([1], [3], [0]), replace(CFG, gamma=0.5))
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.5, 1.0]], dtype=torch.float64))
    torch.testing.assert_close(
        adv, torch.tensor([[-0.87287, -0.21822, 1.09109]], dtype=torch.float64), rtol=1e-4, atol=1e-4
    )


def test_golden_gae_ignores_values_past_the_last_valid_token():
    """γ = 0.9, λ = 0.8, V = 0.5 on 3 valid tokens, reward 1 at the last, V = 99 on padding:
    δ = [−0.05, −0.05, 0.5] (bootstrap 0 after the last), A = [0.1732, 0.31, 0.5],
    returns = A + V = [0.6732, 0.81, 1.0]; padding must not leak in."""
    inputs = _inputs([1], [3], [0], 4, [[0.5, 0.5, 0.5, 99.0]])
    adv, ret = _run("gae", inputs, replace(CFG, gamma=0.9, lam=0.8))
    torch.testing.assert_close(ret, torch.tensor([[0.6732, 0.81, 1.0, 0.0]], dtype=torch.float64))
    a = torch.tensor([0.1732, 0.31, 0.5], dtype=torch.float64)
    expected = (a - a.mean()) / torch.sqrt(a.var() + 1e-8)
    torch.testing.assert_close(adv[0, :3], expected)
    assert adv[0, 3] == 0


def test_gae_without_values_names_the_missing_critic():
    """gae without critic values (a caller's bug: the trainer builds a critic for it) says so,
    not a NoneType error."""
    inputs = _inputs([1], [2], [0])
    with pytest.raises(AssertionError, match="gae needs a critic"):
        _run("gae", inputs)


def test_registry_lists_the_six_built_in_estimators():
    """The names the config selects (algorithm.adv_estimator) are the documented ones."""
    assert set(ESTIMATORS) == {
        "grpo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "opo",
        "gae",
    }
