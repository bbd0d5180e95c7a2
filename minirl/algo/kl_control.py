"""KL in the reward and its coefficient controllers (docs/algorithms.md §4, algorithm.kl_ctrl).

With algorithm.use_kl_in_reward the per-token reward is r = score − β·kl(lp_old, lp_ref). β is
fixed, or adapted once per step towards a target KL:
    e = clip(kl / target_kl − 1, −0.2, 0.2);   β ← β·(1 + e·n_seqs / horizon).
This is core (not a registry): there are exactly two controllers and no third is planned.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from minirl.protocols import Reducer, no_reduce

ADAPTIVE_ERROR_CLIP = 0.2  # the proportional error is clipped so one odd batch cannot swing β


class FixedKLController:
    """β never changes."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_seqs: int) -> None:
        """No-op: the fixed controller ignores the measured KL."""


class AdaptiveKLController:
    """Proportional controller of β towards target_kl (Ziegler et al. 2019)."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_seqs: int) -> None:
        """β ← β·(1 + clip(kl/target − 1, ±0.2)·n_seqs/horizon); n_seqs = sequences this step
        (global, over all ranks, so that every rank keeps the same β)."""
        error = current_kl / self.target - 1.0
        error = min(max(error, -ADAPTIVE_ERROR_CLIP), ADAPTIVE_ERROR_CLIP)
        self.value *= 1.0 + error * n_seqs / self.horizon


def build_kl_controller(cfg: Any) -> FixedKLController | AdaptiveKLController:
    """The controller that algorithm.kl_ctrl describes (every key validated up front)."""
    if cfg.type == "fixed":
        return FixedKLController(cfg.kl_coef)
    return AdaptiveKLController(cfg.kl_coef, cfg.target_kl, cfg.horizon)


def apply_kl_in_reward(
    token_scores_BT: torch.Tensor,
    logp_old_BT: torch.Tensor,
    ref_logp_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    beta: float,
    kl_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    reduce: Reducer = no_reduce,
) -> tuple[torch.Tensor, float]:
    """token_rewards = scores − β·kl_fn(lp_old, lp_ref) on valid tokens (0 on masked ones).

    mean_kl (what the adaptive controller sees) follows verl: the mean over sequences of each
    sequence's token-mean KL; rows with no valid token are not counted. `reduce` makes it the
    mean over all ranks, so every rank updates β identically (one host sync).
    """
    mask_BT = mask_BT.to(token_scores_BT.dtype)
    with torch.no_grad():  # rewards are data, never differentiated
        kl_BT = kl_fn(logp_old_BT, ref_logp_BT) * mask_BT
        rewards_BT = (token_scores_BT - beta * kl_BT) * mask_BT
        tokens_B = mask_BT.sum(-1)
        seq_kl_B = kl_BT.sum(-1) / tokens_B.clamp(min=1.0)
        totals = reduce(torch.stack([seq_kl_B.sum(), (tokens_B > 0).to(seq_kl_B.dtype).sum()]))
    mean_kl = (totals[0] / totals[1].clamp(min=1.0)).item()
    return rewards_BT, mean_kl
