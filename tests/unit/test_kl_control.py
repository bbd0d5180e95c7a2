"""KL controllers and KL in the reward (docs/algorithms.md §4)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minirl.algo.kl_control import apply_kl_in_reward, build_kl_controller
from minirl.config.schema import KLCtrlConfig
from minirl_plugins.algorithms.kl import kl_k1

FAST = settings(max_examples=40, deadline=None)
ADAPTIVE = KLCtrlConfig(type="adaptive", kl_coef=0.01, target_kl=0.1, horizon=10000)


def test_fixed_controller_never_moves():
    """type = fixed: β stays kl_coef whatever KL is measured."""
    ctrl = build_kl_controller(KLCtrlConfig(type="fixed", kl_coef=0.05))
    ctrl.update(current_kl=10.0, n_seqs=512)
    assert ctrl.value == 0.05


def test_golden_adaptive_update():
    """kl 0.15, target 0.1: e = 0.5, clipped to 0.2; β = 0.01·(1 + 0.2·256/10000) = 0.01·1.00512.
    kl 0.09: e = −0.1; β ← β·(1 − 0.1·256/10000)."""
    ctrl = build_kl_controller(ADAPTIVE)
    ctrl.update(0.15, 256)
    assert ctrl.value == pytest.approx(0.01 * 1.00512)
    ctrl.update(0.09, 256)
    assert ctrl.value == pytest.approx(0.01 * 1.00512 * (1 - 0.1 * 256 / 10000))


@FAST
@given(kl=st.floats(0.0, 10.0), n=st.integers(1, 4096))
def test_adaptive_moves_beta_towards_the_target_by_a_bounded_factor(kl, n):
    """β grows when KL is above target, shrinks below, stays at target, and one update changes it
    by at most the factor 1 ± 0.2·n/horizon (the error clip)."""
    ctrl = build_kl_controller(ADAPTIVE)
    ctrl.update(kl, n)
    factor = ctrl.value / 0.01
    bound = 0.2 * n / ADAPTIVE.horizon
    assert 1 - bound - 1e-12 <= factor <= 1 + bound + 1e-12
    step = min(max(kl / ADAPTIVE.target_kl - 1, -0.2), 0.2) * n / ADAPTIVE.horizon
    if abs(step) > 1e-12:  # below that the factor rounds to 1 in float64
        assert (factor > 1) == (kl > ADAPTIVE.target_kl)
    else:
        assert factor == pytest.approx(1.0, abs=1e-11)


def test_bad_controller_settings_are_user_errors():
    """An unknown type, a negative β, a non-positive target or horizon: refused up front by
    validation, each naming its key."""
    from minirl.config.load import load_config
    from minirl.validate.values import CHOICES, RANGES, choice_problems, range_problems

    bad = ["algorithm.kl_ctrl.type=pid", "algorithm.kl_ctrl.kl_coef=-1.0"]
    cfg = load_config(None, bad + ["algorithm.kl_ctrl.target_kl=0.0", "algorithm.kl_ctrl.horizon=0"])
    assert [p.key for p in choice_problems(cfg, CHOICES)] == ["algorithm.kl_ctrl.type"]
    assert [p.key for p in range_problems(cfg, RANGES)] == [
        "algorithm.kl_ctrl.kl_coef",
        "algorithm.kl_ctrl.target_kl",
        "algorithm.kl_ctrl.horizon",
    ]


def test_golden_kl_in_reward():
    """Scores [[0, 1], [0.5, 0]] (second row one valid token), lp_old − lp_ref = [[0.2, 0.4],
    [0.1, 9]]: k1 rewards with β = 0.5 are [[−0.1, 0.8], [0.45, 0]]; mean_kl = mean over sequences
    of the token-mean KL = (0.3 + 0.1)/2 = 0.2 (the masked 9 is ignored)."""
    scores = torch.tensor([[0.0, 1.0], [0.5, 0.0]], dtype=torch.float64)
    lp_old = torch.tensor([[0.2, 0.4], [0.1, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    rewards, mean_kl = apply_kl_in_reward(scores, lp_old, torch.zeros_like(lp_old), mask, 0.5, kl_k1)
    torch.testing.assert_close(rewards, torch.tensor([[-0.1, 0.8], [0.45, 0.0]], dtype=torch.float64))
    assert mean_kl == pytest.approx(0.2)


@FAST
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 6), T=st.integers(1, 5))
def test_zero_beta_leaves_scores_and_two_ranks_agree_on_mean_kl(seed, B, T):
    """β = 0 gives rewards = scores on valid tokens; mean_kl with a reducer over two simulated
    ranks (each holding half the rows) is the mean_kl of the whole batch, so every rank updates β
    identically."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(B, T, generator=gen, dtype=torch.float64)
    lp_old, lp_ref = (torch.randn(B, T, generator=gen, dtype=torch.float64) for _ in range(2))
    mask = (torch.rand(B, T, generator=gen) < 0.7).double()
    rewards, full_kl = apply_kl_in_reward(scores, lp_old, lp_ref, mask, 0.0, kl_k1)
    torch.testing.assert_close(rewards, scores * mask)
    cut = B // 2
    halves = [slice(0, cut), slice(cut, B)]
    local = [_local_kl_sums(scores[h], lp_old[h], lp_ref[h], mask[h]) for h in halves]
    for rank, h in enumerate(halves):
        other = local[1 - rank]
        _, kl = apply_kl_in_reward(
            scores[h], lp_old[h], lp_ref[h], mask[h], 0.0, kl_k1, reduce=lambda x, o=other: x + o
        )
        assert kl == pytest.approx(full_kl, rel=1e-12, abs=1e-12)


def _local_kl_sums(*args):
    """What one rank hands to the all-reduce inside apply_kl_in_reward."""
    seen = []
    apply_kl_in_reward(*args, 0.0, kl_k1, reduce=lambda x: seen.append(x) or x)
    return seen[0]
