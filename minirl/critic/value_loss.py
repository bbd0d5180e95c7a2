"""PPO's clipped value loss (verl's definition) and the explained variance of the values.

Per valid token, with V the current prediction, V_old the values pass's, R the GAE return and
c = critic.cliprange_value:
    V_clip = V_old + clamp(V − V_old, −c, c)
    L      = ½ · max((V − R)², (V_clip − R)²)
The trainer aggregates L with critic.loss_agg_mode over the global mini-batch (minirl.algo.loss_agg),
exactly as the policy loss. Where the clipped branch is strictly larger, V has left the trust
region on the side away from R, and the loss (so the gradient) does not depend on V there.

Shape legend: B sequences, T response positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minirl.protocols import Reducer

EXPLAINED_VAR_EPS = 1e-5  # verl's: a batch of equal returns gives 1 − Var(R − V)/1e-5, not NaN


@dataclass(frozen=True)
class ValueLossOutput:
    """loss_BT: ½·max(unclipped, clipped) squared error; clipped_BT: 1.0 where the clipped
    branch is strictly larger (vf_clipfrac's numerator). Masked positions are 0."""

    loss_BT: torch.Tensor
    clipped_BT: torch.Tensor


def clipped_value_loss(
    vpred_BT: torch.Tensor, old_values_BT: torch.Tensor, returns_BT: torch.Tensor, mask_BT: torch.Tensor, clip: float
) -> ValueLossOutput:
    """The per-token clipped value loss of the module docstring."""
    vclip_BT = old_values_BT + (vpred_BT - old_values_BT).clamp(-clip, clip)
    unclipped_BT = (vpred_BT - returns_BT) ** 2
    clipped_BT = (vclip_BT - returns_BT) ** 2
    m_BT = mask_BT.to(vpred_BT.dtype)
    return ValueLossOutput(
        loss_BT=0.5 * torch.maximum(unclipped_BT, clipped_BT) * m_BT,
        clipped_BT=(clipped_BT > unclipped_BT).to(vpred_BT.dtype) * m_BT,
    )


def explained_variance(returns_BT: torch.Tensor, values_BT: torch.Tensor, mask_BT: torch.Tensor, reduce: Reducer):
    """1 − Var(R − V) / (Var(R) + 1e-5) over the valid tokens of all data-parallel ranks.

    Population variances from global sums (Σm, Σx, Σx²) in float64, one reduce call: 1 means the
    values predict the returns exactly, 0 no better than their mean.
    """
    m = mask_BT.double()
    r, d = returns_BT.double() * m, (returns_BT.double() - values_BT.double()) * m
    n, sr, sr2, sd, sd2 = reduce(torch.stack([m.sum(), r.sum(), (r * r).sum(), d.sum(), (d * d).sum()])).tolist()
    n = max(n, 1.0)
    var_r = max(sr2 / n - (sr / n) ** 2, 0.0)
    var_d = max(sd2 / n - (sd / n) ** 2, 0.0)
    return 1.0 - var_d / (var_r + EXPLAINED_VAR_EPS)
