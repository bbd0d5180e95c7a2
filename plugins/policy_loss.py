"""Built-in policy loss (ALGORITHMS.md §5), selected by actor.policy_loss.

vanilla: PPO clip with clip-higher (separate ε_low / ε_high) and dual clip. Per token:
    ratio = exp(clamp(lp − lp_old, −20, 20))
    L     = max(−A·ratio, −A·clamp(ratio, 1 − ε_low, 1 + ε_high))
    L     = min(L, −A·c)            for A < 0 only, c = actor.clip_ratio_c > 1
The trainer aggregates L (and the metrics) over the global mini-batch with minirl.loss_agg.

Shape legend: B sequences, T response positions.
"""

from __future__ import annotations

from typing import Any

import torch

from minirl import hookimpl
from minirl.errors import UserError
from minirl.protocols import PolicyLossOutput

LOG_RATIO_CLAMP = 20.0  # keeps exp finite; a ratio of e^20 is already fully clipped


def _clip_bounds(cfg: Any) -> tuple[float, float, float]:
    eps_low = cfg.clip_ratio if cfg.clip_ratio_low is None else cfg.clip_ratio_low
    eps_high = cfg.clip_ratio if cfg.clip_ratio_high is None else cfg.clip_ratio_high
    for key, value in (("actor.clip_ratio_low", eps_low), ("actor.clip_ratio_high", eps_high)):
        if value < 0:
            raise UserError(
                f"{key} = {value!r} (unset falls back to actor.clip_ratio): a clip range must be "
                ">= 0; the usual value is 0.2 (clip-higher raises clip_ratio_high, e.g. 0.28)"
            )
    if not cfg.clip_ratio_c > 1.0:
        raise UserError(
            f"actor.clip_ratio_c = {cfg.clip_ratio_c!r}: the dual-clip bound −A·c must lie above "
            "the unclipped loss at ratio 1, so c must be > 1; the default is 3.0"
        )
    return eps_low, eps_high, cfg.clip_ratio_c


def ppo_clip(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, cfg: Any
) -> PolicyLossOutput:
    """PPO-clip with dual clip; cfg is the `actor` section. Masked positions are 0 in every output.

    clipped_BT marks tokens where the clipped branch is strictly larger (so ratio exactly 1 is
    never "clipped"); clipped_lower_BT marks A < 0 tokens capped by the dual clip.
    """
    eps_low, eps_high, clip_c = _clip_bounds(cfg)
    log_ratio_BT = logp - old_logp
    ratio_BT = torch.exp(log_ratio_BT.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped_BT = -advantages * ratio_BT
    clipped_loss_BT = -advantages * ratio_BT.clamp(1.0 - eps_low, 1.0 + eps_high)
    ppo_BT = torch.maximum(unclipped_BT, clipped_loss_BT)
    dual_bound_BT = -advantages * clip_c
    negative_BT = advantages < 0
    loss_BT = torch.where(negative_BT, torch.minimum(ppo_BT, dual_bound_BT), ppo_BT)
    m_BT = mask.to(loss_BT.dtype)
    return PolicyLossOutput(
        loss_BT=loss_BT * m_BT,
        clipped_BT=(clipped_loss_BT > unclipped_BT).to(loss_BT.dtype) * m_BT,
        clipped_lower_BT=(negative_BT & (ppo_BT > dual_bound_BT)).to(loss_BT.dtype) * m_BT,
        approx_kl_BT=(-log_ratio_BT).detach() * m_BT,
    )


@hookimpl
def minirl_policy_losses() -> dict:
    return {"vanilla": ppo_clip}
