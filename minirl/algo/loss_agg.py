"""Loss aggregation (actor.loss_agg_mode), exact over the global mini-batch (docs/algorithms.md §6).

A mini-batch is split into micro-batches (gradient accumulation) and over data-parallel ranks.
Averaging each micro-batch's own mean and then averaging those (what many frameworks do) weights
tokens by how the batch happened to be split. minirl instead counts tokens and sequences of the
whole mini-batch once (`mini_batch_norm`, one all-reduce), and each micro-batch contributes its
partial *sum* divided by those global counts (`aggregate`). The sum of the contributions over all
micro-batches and ranks is then exactly the global value, and so is its gradient, for any split
(the ranks' gradients are summed, not averaged: minirl.dist.context.DistContext).

Valid tokens are the mask's 1s: a multi-turn response's tool and user tokens (mask 0) are neither
summed nor counted, so a sequence's token count is its model tokens, and seq-mean-token-sum-norm's
S is a constant, never the padded width (tests/unit/test_masked_math.py). Sequences with no valid
token (padding rows, or only tool tokens) are not counted: they contribute nothing and must not
dilute the seq-mean modes. With sequence parallelism the masks are still the full-sequence masks
(a sequence split over shards is one sequence).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from minirl.protocols import Reducer


@dataclass(frozen=True)
class AggNorm:
    """Global counts of one mini-batch, over all micro-batches and data-parallel ranks.

    tokens: Σ m. seqs: sequences with at least one valid token. scale: S of
    seq-mean-token-sum-norm (actor.loss_scale_factor, or the max response length).
    """

    tokens: float
    seqs: float
    scale: float


def mini_batch_norm(
    mask_BT: torch.Tensor, reduce: Reducer, loss_scale_factor: float | None, max_response_length: int
) -> AggNorm:
    """Count the mini-batch's tokens and sequences over every rank: one reduce of a stacked
    float64 tensor (float32 counts stop being exact above 2^24 tokens, which a large mini-batch
    reaches), so one host sync per mini-batch."""
    scale = max_response_length if loss_scale_factor is None else loss_scale_factor
    assert scale > 0, "validation requires actor.loss_scale_factor > 0 and data.max_response_length >= 1"
    tokens_B = mask_BT.to(torch.float64).sum(-1)
    tokens, seqs = reduce(torch.stack([tokens_B.sum(), (tokens_B > 0).to(torch.float64).sum()])).tolist()
    return AggNorm(tokens=tokens, seqs=seqs, scale=float(scale))


def _per_token_sum(loss_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    return (loss_BT * mask_BT).sum()


def _token_mean(loss_BT: torch.Tensor, mask_BT: torch.Tensor, norm: AggNorm) -> torch.Tensor:
    """Σ L·m / Σ m (global Σ m)."""
    return _per_token_sum(loss_BT, mask_BT) / max(norm.tokens, 1.0)


def _seq_mean_token_sum(loss_BT: torch.Tensor, mask_BT: torch.Tensor, norm: AggNorm) -> torch.Tensor:
    """mean over sequences of Σ_t L·m: Σ L·m / (global number of sequences)."""
    return _per_token_sum(loss_BT, mask_BT) / max(norm.seqs, 1.0)


def _seq_mean_token_mean(loss_BT: torch.Tensor, mask_BT: torch.Tensor, norm: AggNorm) -> torch.Tensor:
    """mean over sequences of (Σ_t L·m / Σ_t m); a row with no valid token contributes 0."""
    tokens_B = mask_BT.sum(-1).clamp(min=1.0)
    return ((loss_BT * mask_BT).sum(-1) / tokens_B).sum() / max(norm.seqs, 1.0)


def _seq_mean_token_sum_norm(loss_BT: torch.Tensor, mask_BT: torch.Tensor, norm: AggNorm) -> torch.Tensor:
    """Σ L·m / (number of sequences · S) (Dr.GRPO's constant normaliser)."""
    return _per_token_sum(loss_BT, mask_BT) / (max(norm.seqs, 1.0) * norm.scale)


LOSS_AGG_MODES: dict[str, Callable[[torch.Tensor, torch.Tensor, AggNorm], torch.Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def aggregate(loss_BT: torch.Tensor, mask_BT: torch.Tensor, mode: str, norm: AggNorm) -> torch.Tensor:
    """This micro-batch's contribution to the mini-batch loss (a 0-d tensor).

    Summed over every micro-batch and rank of the mini-batch it equals the `mode` aggregate of
    the whole mini-batch, value and gradient. Empty counts divide by 1 (the sums are then 0).
    `mode` is validated up front (minirl.validate).
    """
    return LOSS_AGG_MODES[mode](loss_BT, mask_BT.to(loss_BT.dtype), norm)
