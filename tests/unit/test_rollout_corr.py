"""Rollout / training mismatch metrics and truncated importance sampling (minirl.algo.rollout_corr).

Golden values by hand, the exact cross-rank reduction, TIS off bit for bit, the error without
rollout log-probs, and TIS composed with GSPO and the global normalisation in a real update."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from minirl import build
from minirl.algo.loss_agg import mini_batch_norm
from minirl.algo.rollout_corr import MismatchStats, require_rollout_log_probs, rollout_log_probs_BT, tis_weights
from minirl.algo.stats import DeviceSums
from minirl.batch import MicroBatching, RolloutBatch, response_mask
from minirl.config.load import load_config
from minirl.dist.context import DistContext
from minirl.errors import UserError
from minirl.forward.packed import logprob_head, per_token_pass
from minirl.models.loading import random_model
from minirl.models.presets import preset_config
from minirl.plugins import PluginManager
from minirl.protocols import Completion
from minirl.update import actor as actor_lib
from tests.batches import three_groups

CPU = torch.device("cpu")
DIST = DistContext(device=CPU)
LN = math.log


def _lp(rows):
    return torch.tensor([[LN(p) if p else 0.0 for p in row] for row in rows], dtype=torch.float64)


# ---------------------------------------------------------------------------------------------
# mismatch metrics
# ---------------------------------------------------------------------------------------------


def test_mismatch_golden_values():
    """p_old = [[.5, .25], [.8, pad]], p_roll = [[.4, .25], [.5, pad]]: |Δp| = .1, 0, .3 → mean
    0.4/3, max .3; lp_old − lp_roll = ln 1.25, 0, ln 1.6 → mean ln 2 / 3. The padded position
    (where the values would give |Δp| = .7) is not counted."""
    old, roll = _lp([[0.5, 0.25], [0.8, 0.1]]), _lp([[0.4, 0.25], [0.5, 0.8]])
    stats = MismatchStats(CPU)
    stats.add(old, roll, torch.tensor([[1.0, 1.0], [1.0, 0.0]]))
    got = stats.reduced(DIST)
    assert got["rollout_corr/prob_diff_mean"] == pytest.approx(0.4 / 3, rel=1e-12)
    assert got["rollout_corr/prob_diff_max"] == pytest.approx(0.3, rel=1e-12)
    assert got["rollout_corr/log_ratio_mean"] == pytest.approx(LN(2) / 3, rel=1e-12)


def test_identical_log_probs_give_zero():
    lp = -torch.rand(3, 5, dtype=torch.float64) * 4
    stats = MismatchStats(CPU)
    stats.add(lp, lp.clone(), torch.ones(3, 5))
    assert set(stats.reduced(DIST).values()) == {0.0}


class TwoRanks:
    """all_reduce over this rank and one other whose tensors are given (sum or max)."""

    def __init__(self, other: MismatchStats):
        self.other = other

    def all_reduce(self, x, op="sum"):
        if op == "max":
            return torch.maximum(x, self.other.max)
        return x + self.other.sums


def test_two_ranks_reduce_to_the_global_token_mean_and_max():
    """Ranks with 3 and 1 valid tokens: the mean is over all 4 tokens (not the mean of the two
    ranks' means), the max is the larger rank's, and both ranks report the same numbers."""
    gen = torch.Generator().manual_seed(0)
    old, roll = (-torch.rand(4, 3, generator=gen, dtype=torch.float64) for _ in range(2))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    whole = MismatchStats(CPU)
    whole.add(old, roll, mask)
    ranks = [MismatchStats(CPU), MismatchStats(CPU)]
    ranks[0].add(old[:2], roll[:2], mask[:2])
    ranks[1].add(old[2:], roll[2:], mask[2:])
    want = whole.reduced(DIST)
    for r in (0, 1):
        got = ranks[r].reduced(TwoRanks(ranks[1 - r]))
        assert got == pytest.approx(want, rel=1e-12)


def test_rollout_log_probs_layout_and_bad_engines():
    """[B, T] with 0 after each response; None when the engine returns none; a count that differs
    from the tokens names the engine."""
    comps = [Completion([5, 6, 7], [-0.1, -0.2, -0.3]), Completion([8], [-0.4])]
    mask = response_mask([c.token_ids for c in comps], CPU)
    got = rollout_log_probs_BT(comps, mask, "native")
    torch.testing.assert_close(got, torch.tensor([[-0.1, -0.2, -0.3], [-0.4, 0.0, 0.0]]))
    assert rollout_log_probs_BT([Completion([5], None)], mask[:1], "mine") is None
    with pytest.raises(UserError, match="rollout.name = 'mine': completion 0 has 1 tokens but 2 log-probs"):
        rollout_log_probs_BT([Completion([5], [-0.1, -0.2])], mask[:1], "mine")


# ---------------------------------------------------------------------------------------------
# TIS
# ---------------------------------------------------------------------------------------------


def _mb(mask_BT, rollout_BT) -> RolloutBatch:
    B = mask_BT.shape[0]
    return RolloutBatch(
        [[1]] * B, [[1]] * B, torch.zeros(B, dtype=torch.long), mask_BT, rollout_log_probs_BT=rollout_BT
    )


def test_tis_golden_values():
    """cap 3. lp_old − lp_roll = −ln 2, 0, ln 4, ln 3 (padding) → w = 0.5, 1, 3 (capped from 4);
    loss [1, −2, 0.5] → [0.5, −2, 1.5]. Logged: mean weight 4.5 / 3 = 1.5 over the valid tokens,
    1/3 of them at the cap."""
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    old = torch.tensor([[0.0, -1.0, LN(4), LN(3)]], dtype=torch.float64)
    roll = torch.tensor([[LN(2), -1.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(tis_weights(old, roll, 3.0), torch.tensor([[0.5, 1.0, 3.0, 3.0]], dtype=torch.float64))
    sums = DeviceSums()
    norm = mini_batch_norm(mask, lambda x: x, None, 4)
    loss = torch.tensor([[1.0, -2.0, 0.5, 0.0]], dtype=torch.float64)
    out = actor_lib._tis(loss, old, _mb(mask, roll), 3.0, norm, sums)
    torch.testing.assert_close(out, torch.tensor([[0.5, -2.0, 1.5, 0.0]], dtype=torch.float64))
    assert float(sums.sums["tis_weight_mean"]) == pytest.approx(1.5, rel=1e-12)
    assert float(sums.sums["tis_capped_frac"]) == pytest.approx(1 / 3, rel=1e-12)


def test_tis_weight_is_detached():
    old = torch.zeros(1, 2, requires_grad=True)
    assert not tis_weights(old, torch.tensor([[-1.0, 1.0]]), 2.0).requires_grad


def test_tis_off_returns_the_loss_itself():
    loss = torch.randn(2, 3)
    mb = _mb(torch.ones(2, 3), torch.zeros(2, 3))
    assert actor_lib._tis(loss, loss, mb, -1.0, None, DeviceSums()) is loss


def test_tis_with_an_engine_that_returns_no_log_probs_is_a_user_error():
    """Validation checks rollout.calculate_log_probs; whether the engine returns log-probs is
    known only after it generated, so generate checks that once (the update only asserts it)."""
    require_rollout_log_probs(None, -1.0, "hf")  # off: nothing needed
    with pytest.raises(
        UserError, match=r"actor\.tis_imp_ratio_cap = 2\.0 .*rollout\.name = 'hf' returned no Completion"
    ):
        require_rollout_log_probs(None, 2.0, "hf")


# ---------------------------------------------------------------------------------------------
# in a real update (tiny model, CPU)
# ---------------------------------------------------------------------------------------------

N = 2


def _batch() -> RolloutBatch:
    return three_groups(1, [6, 6, 9, 9, 4, 4], [5, 2, 7, 3, 1, 6])


def _setup(extra: list[str]):
    base = ["data.train_batch_size=3", "actor.ppo_mini_batch_size=3", f"rollout.n={N}", "actor.optim.lr=0.01"]
    base.append("data.max_response_length=16")
    cfg = load_config(None, base + extra)
    pm = PluginManager()
    losses = actor_lib.Losses(pm["policy_losses"].get(cfg.actor.policy_loss))
    return cfg, losses, random_model(preset_config("tiny"), "cpu", torch.float32, seed=3)


def _update(model, cfg, losses, batch, on_policy: bool = True):
    m = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(m.parameters(), lr=cfg.actor.optim.lr)
    job = build.actor_update(cfg, m, optimizer, losses, DIST, on_policy)
    return actor_lib.update_actor(job, batch, DIST), m


def _old_log_probs(model, batch):
    return per_token_pass(model, batch, MicroBatching(8), logprob_head(1.0), DIST)


def test_tis_off_is_the_current_update_bit_for_bit():
    """tis_imp_ratio_cap = -1 with rollout log-probs in the batch: the same metrics (plus the
    rollout_corr ones) and the same updated weights as a batch without them."""
    cfg, losses, model = _setup([])
    plain, with_lp = _batch(), _batch()
    with_lp.rollout_log_probs_BT = _old_log_probs(model, with_lp) - 0.1 * with_lp.mask_BT
    (m_plain, w_plain), (m_lp, w_lp) = _update(model, cfg, losses, plain), _update(model, cfg, losses, with_lp)
    assert {k: v for k, v in m_lp.items() if not k.startswith("rollout_corr/")} == m_plain
    assert m_lp["rollout_corr/log_ratio_mean"] == pytest.approx(0.1, rel=1e-4)
    for (name, a), b in zip(w_plain.named_parameters(), w_lp.parameters()):
        assert torch.equal(a, b), name


def test_update_without_rollout_log_probs_asserts_under_tis():
    """A programmer error by then: validation and generate refuse TIS without them."""
    cfg, losses, model = _setup(["actor.tis_imp_ratio_cap=2.0"])
    with pytest.raises(AssertionError, match="TIS without rollout log-probs"):
        _update(model, cfg, losses, _batch())


@pytest.mark.parametrize("on_policy", [True, False])
def test_gspo_with_tis_in_an_update_by_hand(on_policy):
    """GSPO, seq-mean-token-mean, cap 1.5, one mini-batch: lp_old = lp, so s_i = 1 and the loss is
    mean over sequences of (1/|y_i|) Σ_t −A_i·min(exp(lp − lp_roll), 1.5); the mismatch metrics
    follow their formulas. The on-policy shortcut (old log-probs from the update's own forward)
    and the separate pass report the same numbers."""
    cfg, losses, model = _setup(
        ["actor.policy_loss=gspo", "actor.loss_agg_mode=seq-mean-token-mean", "actor.tis_imp_ratio_cap=1.5"]
    )
    batch = _batch()
    lp = _old_log_probs(model, batch).double()
    mask, adv = batch.mask_BT.double(), batch.advantages_BT.double()
    noise = (torch.rand(lp.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64) - 0.5) * 1.6
    roll = (lp + noise) * mask
    batch.rollout_log_probs_BT = roll.float()
    if not on_policy:
        batch.old_log_probs_BT = lp.float()
    metrics, _ = _update(model, cfg, losses, batch, on_policy)
    w = torch.exp(lp - roll.float().double()).clamp(max=1.5)
    lens = mask.sum(-1)
    assert metrics["actor/pg_loss"] == pytest.approx(((-adv * w * mask).sum(-1) / lens).mean().item(), rel=1e-5)
    assert metrics["actor/tis_weight_mean"] == pytest.approx(((w * mask).sum() / mask.sum()).item(), rel=1e-5)
    capped = (((w >= 1.5) * mask).sum() / mask.sum()).item()
    assert 0 < capped < 1 and metrics["actor/tis_capped_frac"] == pytest.approx(capped, rel=1e-6)
    dp = (lp.exp() - roll.float().double().exp()).abs() * mask
    assert metrics["rollout_corr/prob_diff_mean"] == pytest.approx((dp.sum() / mask.sum()).item(), rel=1e-5)
    assert metrics["rollout_corr/prob_diff_max"] == pytest.approx(dp.max().item(), rel=1e-5)
    log_ratio = ((lp - roll.float().double()) * mask).sum() / mask.sum()
    assert metrics["rollout_corr/log_ratio_mean"] == pytest.approx(log_ratio.item(), rel=1e-5, abs=1e-6)
