"""Rollout / training mismatch: the engine's sampled-token log-probs lp_roll (kept as
RolloutBatch.rollout_log_probs_BT with rollout.calculate_log_probs) against the old log-probs lp_old
the update uses. The engine samples with its own kernels (bf16, CUDA graphs, another attention),
so the two differ for the same weights. Here: the mismatch metrics, rollout_corr/* over the valid
tokens of the step on every rank (docs/algorithms.md §7), and truncated importance sampling
(actor.tis_imp_ratio_cap = C > 0, §5): each token's policy loss is weighted by
w = min(exp(lp_old − lp_roll), C), detached, since the samples come from π_roll, not π_old.
Legend: B sequences, T response positions.
"""

from __future__ import annotations

import array
import itertools

import torch

from minirl.batch import scatter_rows
from minirl.dist.transfer import to_device
from minirl.errors import UserError


def rollout_log_probs_BT(completions, mask_BT: torch.Tensor, engine: str) -> torch.Tensor | None:
    """The completions' sampled-token log-probs as [B, T] (0 after the last token), or None when
    the engine returned none. A count that differs from the token count is the engine's bug."""
    if any(c.logprobs is None for c in completions):
        return None
    for i, c in enumerate(completions):
        if len(c.logprobs) != len(c.token_ids):
            raise UserError(
                f"rollout.name = {engine!r}: completion {i} has {len(c.token_ids)} tokens but {len(c.logprobs)} "
                "log-probs; the engine must return one log-prob per sampled token (Completion.logprobs); fix the "
                "engine, or set rollout.calculate_log_probs = false (and actor.tis_imp_ratio_cap = -1)"
            )
    flat = array.array("f", itertools.chain.from_iterable(c.logprobs for c in completions))  # 3x torch.tensor(list)
    flat_N = torch.frombuffer(flat, dtype=torch.float32) if len(flat) else torch.zeros(0)
    return scatter_rows(to_device(flat_N, mask_BT.device), [len(c.token_ids) for c in completions], mask_BT)


def require_rollout_log_probs(rollout_BT: torch.Tensor | None, cap: float, engine: str) -> None:
    """TIS needs the engine's log-probs. Validation has checked that rollout.calculate_log_probs
    asks for them; whether the engine returns them is known only once it has generated."""
    if cap > 0 and rollout_BT is None:
        raise UserError(
            f"actor.tis_imp_ratio_cap = {cap!r} needs the rollout engine's sampled-token log-probs, but "
            f"rollout.name = {engine!r} returned no Completion.logprobs: use an engine that returns them "
            "(native, hf and sglang do), or set actor.tis_imp_ratio_cap = -1"
        )


def tis_weights(old_BT: torch.Tensor, rollout_BT: torch.Tensor, cap: float) -> torch.Tensor:
    """w = min(exp(lp_old − lp_roll), cap), detached: one weight per token, so a multi-turn
    response's tool tokens enter no product. Masked positions (padding, tool tokens) get some
    weight; the per-token loss there is 0 already."""
    return torch.exp(old_BT.detach() - rollout_BT).clamp(max=cap)


class MismatchStats:
    """Local sums of one step's mismatch, reduced exactly over data-parallel ranks at the end:
    sums and the token count by one all-reduce (float64), the maximum by another."""

    def __init__(self, device):
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)  # Σ m|Δp|, Σ m·(lp_old − lp_roll), Σ m
        self.max = torch.zeros((), dtype=torch.float64, device=device)

    def add(self, old_BT: torch.Tensor, rollout_BT: torch.Tensor, mask_BT: torch.Tensor) -> None:
        old, roll, m = (x.detach().to(torch.float64) for x in (old_BT, rollout_BT, mask_BT))
        diff_BT = (old.exp() - roll.exp()).abs() * m
        self.sums += torch.stack([diff_BT.sum(), ((old - roll) * m).sum(), m.sum()])
        self.max = torch.maximum(self.max, diff_BT.max() if diff_BT.numel() else self.max)

    def reduced(self, dist) -> dict[str, float]:
        diff_sum, log_ratio_sum, tokens = dist.all_reduce(self.sums).tolist()
        tokens = max(tokens, 1.0)
        return {
            "rollout_corr/prob_diff_mean": diff_sum / tokens,
            "rollout_corr/prob_diff_max": float(dist.all_reduce(self.max, "max")),
            "rollout_corr/log_ratio_mean": log_ratio_sum / tokens,
        }
