"""Built-in policy losses (docs/algorithms.md §5), selected by actor.policy_loss.

vanilla: PPO clip with clip-higher (separate ε_low / ε_high) and dual clip. gspo: GSPO (Zheng
et al. 2025), the importance ratio and its clip taken per sequence, not per token. The trainer
aggregates L over the global mini-batch (minirl.algo.loss_agg), after the optional truncated
importance weight (minirl.algo.rollout_corr).

Shape legend: B sequences, T response positions.
"""

from __future__ import annotations

from typing import Any

import torch

from minirl import hookimpl
from minirl.protocols import PolicyLossOutput

LOG_RATIO_CLAMP = 20.0  # keeps exp finite; a ratio of e^20 is already fully clipped


def _clip_bounds(cfg: Any, unset_low: float, unset_high: float) -> tuple[float, float]:
    """ε_low, ε_high: actor.clip_ratio_low / _high, where unset the loss's own default. Their
    ranges (>= 0, GSPO's ε_low < 1) and clip_ratio_c > 1 are rules of the validation pass."""
    eps_low = unset_low if cfg.clip_ratio_low is None else cfg.clip_ratio_low
    eps_high = unset_high if cfg.clip_ratio_high is None else cfg.clip_ratio_high
    return eps_low, eps_high


def ppo_clip(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, cfg: Any
) -> PolicyLossOutput:
    """PPO-clip with dual clip; cfg is the `actor` section. Masked positions are 0 in every output.

    clipped_BT marks tokens where the clipped branch is strictly larger (so ratio exactly 1 is
    never "clipped"); clipped_lower_BT marks A < 0 tokens capped by the dual clip.
    """
    eps_low, eps_high = _clip_bounds(cfg, cfg.clip_ratio, cfg.clip_ratio)  # verl: unset means clip_ratio
    log_ratio_BT = logp - old_logp
    ratio_BT = torch.exp(log_ratio_BT.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped_BT = -advantages * ratio_BT
    clipped_loss_BT = -advantages * ratio_BT.clamp(1.0 - eps_low, 1.0 + eps_high)
    ppo_BT = torch.maximum(unclipped_BT, clipped_loss_BT)
    dual_bound_BT = -advantages * cfg.clip_ratio_c
    negative_BT = advantages < 0
    loss_BT = torch.where(negative_BT, torch.minimum(ppo_BT, dual_bound_BT), ppo_BT)
    m_BT = mask.to(loss_BT.dtype)
    return PolicyLossOutput(
        loss_BT=loss_BT * m_BT,
        clipped_BT=(clipped_loss_BT > unclipped_BT).to(loss_BT.dtype) * m_BT,
        clipped_lower_BT=(negative_BT & (ppo_BT > dual_bound_BT)).to(loss_BT.dtype) * m_BT,
        approx_kl_BT=(-log_ratio_BT).detach() * m_BT,
    )


GSPO_CLIP_LOW = 3e-4  # the GSPO paper's ε_low / ε_high: sequence ratios stay within ~1e-3 of 1
GSPO_CLIP_HIGH = 4e-4


def gspo(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, cfg: Any
) -> PolicyLossOutput:
    """GSPO-token; cfg is the `actor` section. With m the mask and |y_i| = Σ_t m[i,t] (at least 1):

        s_i     = exp( clamp( (1/|y_i|) Σ_t m·(lp − lp_old), −20, 20 ) )   sequence ratio, length-normalised
        s_{i,t} = sg[s_i] · exp(lp_t − sg[lp_t])                          value s_i, gradient s_i·∇lp_t
        L_{i,t} = max(−A_{i,t}·s_{i,t}, −A_{i,t}·clip(s_{i,t}, 1 − ε_low, 1 + ε_high))

    Every token of sequence i carries s_i's value and the same clip decision; the gradient flows
    through each token's own lp_t. With an outcome advantage A_i and seq-mean-token-mean this is
    the paper's sequence objective, ∇ = −A_i·s_i·(1/|y_i|)·Σ_t ∇lp_t while unclipped; a clipped
    sequence gets no gradient. ε: actor.clip_ratio_low / _high, unset = 3e-4 / 4e-4; no dual clip
    (clip_ratio_c unused). Metrics: clipped_BT marks the tokens of clipped sequences, approx_kl_BT
    is the per-token lp_old − lp (ppo_kl), clipped_lower_BT is 0. Masked positions are 0 in every
    output.
    """
    eps_low, eps_high = _clip_bounds(cfg, GSPO_CLIP_LOW, GSPO_CLIP_HIGH)  # clip_ratio is PPO's, unused
    m_BT = mask.to(logp.dtype)
    log_ratio_BT = (logp - old_logp) * m_BT
    len_B = m_BT.sum(-1).clamp(min=1.0)
    seq_ratio_B = torch.exp((log_ratio_BT.detach().sum(-1) / len_B).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    ratio_BT = seq_ratio_B[:, None] * torch.exp(logp - logp.detach())
    unclipped_BT = -advantages * ratio_BT
    clipped_loss_BT = -advantages * ratio_BT.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss_BT = torch.maximum(unclipped_BT, clipped_loss_BT)
    return PolicyLossOutput(
        loss_BT=loss_BT * m_BT,
        clipped_BT=(clipped_loss_BT > unclipped_BT).to(loss_BT.dtype) * m_BT,
        clipped_lower_BT=torch.zeros_like(m_BT),
        approx_kl_BT=(-log_ratio_BT).detach(),
    )


@hookimpl
def minirl_policy_losses() -> dict:
    return {"vanilla": ppo_clip, "gspo": gspo}
