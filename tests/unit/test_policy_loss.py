"""PPO clip with dual clip (docs/algorithms.md §5)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minirl.config.schema import ActorConfig
from minirl_plugins.algorithms.policy_loss import minirl_policy_losses

FAST = settings(max_examples=40, deadline=None)
PPO = minirl_policy_losses()["vanilla"]
CFG = ActorConfig()

floats = st.lists(st.floats(-5.0, 5.0), min_size=1, max_size=10)


def _tensors(*columns):
    n = min(len(c) for c in columns)
    return [torch.tensor(c[:n], dtype=torch.float64) for c in columns]


@FAST
@given(lp=floats, adv=floats, mask=st.lists(st.booleans(), min_size=10, max_size=10))
def test_on_policy_ratio_is_exactly_one(lp, adv, mask):
    """One mini-batch, one epoch: lp_old = lp detached, ratio exactly 1, so the loss is −A on
    valid tokens, nothing is clipped, ppo_kl is 0, and the gradient to lp is −A (the plain policy
    gradient)."""
    logp, advantages = _tensors(lp, adv)
    m = torch.tensor(mask[: len(logp)], dtype=torch.float64)
    logp.requires_grad_()
    out = PPO(logp, logp.detach(), advantages, m, CFG)
    assert torch.equal(out.loss_BT, -advantages * m)
    assert torch.all(out.clipped_BT == 0) and torch.all(out.clipped_lower_BT == 0)
    assert torch.all(out.approx_kl_BT == 0)
    out.loss_BT.sum().backward()
    torch.testing.assert_close(logp.grad, -advantages * m)


@FAST
@given(
    lp=floats,
    old=floats,
    adv=st.lists(st.floats(-5.0, -1e-3), min_size=1, max_size=10),
    c=st.floats(1.01, 10.0),
)
def test_dual_clip_caps_the_loss_at_minus_a_c_for_negative_advantages(lp, old, adv, c):
    """For A < 0 the loss never exceeds −A·c, and it equals −A·c (dual clip active) exactly when
    the PPO-clip loss would be larger, however large the ratio."""
    logp, old_logp, advantages = _tensors(lp, old, adv)
    cfg = replace(CFG, clip_ratio_c=c)
    out = PPO(logp, old_logp, advantages, torch.ones_like(logp), cfg)
    cap = -advantages * c
    assert bool((out.loss_BT <= cap + 1e-12).all())
    torch.testing.assert_close(out.loss_BT[out.clipped_lower_BT == 1], cap[out.clipped_lower_BT == 1])
    huge = PPO(old_logp + 15.0, old_logp, advantages, torch.ones_like(logp), cfg)
    torch.testing.assert_close(huge.loss_BT, cap)
    assert torch.all(huge.clipped_lower_BT == 1)


@FAST
@given(
    lp=floats,
    old=floats,
    adv=floats,
    low=st.floats(0.0, 0.5),
    high=st.floats(0.0, 0.5),
    mask=st.lists(st.booleans(), min_size=10, max_size=10),
)
def test_matches_the_per_token_case_analysis(lp, old, adv, low, high, mask):
    """Against a scalar, branch-by-branch restatement of docs/algorithms.md §5 (clip-higher bounds,
    strict clip indicator, dual clip for A < 0 only), with masked positions 0 in every output."""
    logp, old_logp, advantages = _tensors(lp, old, adv)
    m = torch.tensor(mask[: len(logp)], dtype=torch.float64)
    cfg = replace(CFG, clip_ratio_low=low, clip_ratio_high=high)
    out = PPO(logp, old_logp, advantages, m, cfg)
    for i in range(len(logp)):
        ratio = torch.exp((logp[i] - old_logp[i]).clamp(-20, 20)).item()
        a = advantages[i].item()
        plain, clipped = -a * ratio, -a * min(max(ratio, 1 - low), 1 + high)
        loss = max(plain, clipped)
        dual = a < 0 and loss > -a * CFG.clip_ratio_c
        loss = -a * CFG.clip_ratio_c if dual else loss
        assert out.loss_BT[i].item() == pytest.approx(loss * m[i].item(), rel=1e-12, abs=1e-12)
        assert out.clipped_BT[i].item() == float(clipped > plain) * m[i].item()
        assert out.clipped_lower_BT[i].item() == float(dual) * m[i].item()


def test_golden_clip_higher():
    """ε_low 0.2, ε_high 0.28. A = 1, ratio 1.5: loss −1.28, clipped. A = −1, ratio 0.5:
    max(0.5, 0.8) = 0.8, clipped. A = −1, ratio 4: min(max(4, 1.28), 3) = 3, dual clip.
    A = 2, ratio 0.5: max(−1, −1.6) = −1, not clipped (the unclipped branch is larger)."""
    import math

    ratios = torch.tensor([1.5, 0.5, 4.0, 0.5], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, -1.0, 2.0], dtype=torch.float64)
    old = torch.zeros(4, dtype=torch.float64)
    cfg = replace(CFG, clip_ratio_low=0.2, clip_ratio_high=0.28)
    out = PPO(torch.log(ratios), old, adv, torch.ones(4, dtype=torch.float64), cfg)
    torch.testing.assert_close(out.loss_BT, torch.tensor([-1.28, 0.8, 3.0, -1.0], dtype=torch.float64))
    assert out.clipped_BT.tolist() == [
        1.0,
        1.0,
        0.0,
        0.0,
    ]  # ratio 4 with A < 0: the max picks the unclipped branch
    assert out.clipped_lower_BT.tolist() == [0.0, 0.0, 1.0, 0.0]
    torch.testing.assert_close(out.approx_kl_BT, -torch.log(ratios))
    assert math.isclose(out.approx_kl_BT[0].item(), -math.log(1.5))


def test_unset_low_high_fall_back_to_clip_ratio():
    """clip_ratio_low/high = None mean clip_ratio (verl's convention): with clip_ratio 0.1,
    A = 1 and ratio 2 the loss is −1.1."""
    out = PPO(
        torch.log(torch.tensor([2.0])),
        torch.zeros(1),
        torch.ones(1),
        torch.ones(1),
        replace(CFG, clip_ratio=0.1),
    )
    torch.testing.assert_close(out.loss_BT, torch.tensor([-1.1]))


def test_bad_clip_settings_are_refused_by_validation():
    """clip_ratio_c <= 1 would cap the loss below its on-policy value; a negative clip range is
    meaningless; GSPO's 1 − clip_ratio_low must stay > 0. The validation pass refuses each, naming
    the key (the losses take their bounds as given, on every micro-batch)."""
    from minirl.config.load import load_config
    from minirl.validate.options import policy_loss_problems
    from minirl.validate.values import RANGES, range_problems

    cfg = load_config(None, ["actor.clip_ratio_c=1.0", "actor.clip_ratio_high=-0.1"])
    assert {p.key for p in range_problems(cfg, RANGES)} == {"actor.clip_ratio_c", "actor.clip_ratio_high"}
    gspo = load_config(None, ["actor.policy_loss=gspo", "actor.clip_ratio_low=1.0"])
    assert [p.key for p in policy_loss_problems(gspo, None)] == ["actor.clip_ratio_low"]


def test_registry():
    """actor.policy_loss = "vanilla" selects ppo_clip, "gspo" GSPO (tests/unit/test_gspo.py)."""
    assert set(minirl_policy_losses()) == {"vanilla", "gspo"}
