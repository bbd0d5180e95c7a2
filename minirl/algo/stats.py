"""Masked batch statistics that stay exact across data-parallel ranks (docs/algorithms.md §1).

Every batch-wide statistic takes a `reduce` (minirl.protocols.Reducer) that sums a tensor over
the data-parallel ranks. The functions reduce *sums* (Σx·m, Σm, then Σ(x−mean)²·m in a second
pass), never local means or variances, so the result on every rank equals the statistic of the
concatenated global batch. With the default `no_reduce` they are ordinary local statistics.

Masks are 0/1 (float or bool); `x` and `mask` broadcast together (usually both [B, T]).
"""

from __future__ import annotations

import torch

from minirl.protocols import Reducer, no_reduce

EPS = 1e-8  # the epsilon of docs/algorithms.md §1, in masked_mean and in the whitening denominator


def masked_sum(x: torch.Tensor, mask: torch.Tensor, reduce: Reducer = no_reduce) -> torch.Tensor:
    """Σ x·m over every element (and every rank): a 0-d tensor."""
    return reduce((x * mask).sum())


def _sum_and_count(x: torch.Tensor, mask: torch.Tensor, reduce: Reducer) -> tuple[torch.Tensor, torch.Tensor]:
    # One collective for both numbers: (Σ x·m, Σ m) stacked.
    mask = mask.to(x.dtype)
    totals = reduce(torch.stack([(x * mask).sum(), mask.expand_as(x).sum()]))
    return totals[0], totals[1]


def masked_mean(x: torch.Tensor, mask: torch.Tensor, reduce: Reducer = no_reduce) -> torch.Tensor:
    """Σ x·m / (Σ m + 1e-8) over the global batch; 0 when nothing is valid."""
    total, count = _sum_and_count(x, mask, reduce)
    return total / (count + EPS)


def masked_var(x: torch.Tensor, mask: torch.Tensor, reduce: Reducer = no_reduce) -> torch.Tensor:
    """Unbiased variance Σ(x−mean)²·m / (N−1) over the global batch, N = Σ m.

    Two passes (mean first, then squared deviations) rather than Σx² − N·mean², which cancels
    catastrophically for large offsets. Choices (docs/algorithms.md leaves them open): with N ≤ 1 the
    variance is 0 instead of an error or NaN (no host sync to check N); the mean used here and in
    masked_whiten is the exact Σx·m / N (N ≥ 1), not masked_mean's Σx·m / (N + 1e-8), so
    constant data (a single valid token, equal advantages) whitens to exactly 0 rather than to
    x·1e-8 / 1e-4.
    """
    var, _ = _mean_var(x, mask, reduce)
    return var


def _mean_var(x: torch.Tensor, mask: torch.Tensor, reduce: Reducer) -> tuple[torch.Tensor, torch.Tensor]:
    total, count = _sum_and_count(x, mask, reduce)
    mean = total / count.clamp(min=1.0)
    mask = mask.to(x.dtype)
    sq_dev = reduce(((x - mean) ** 2 * mask).sum())
    return sq_dev / (count - 1.0).clamp(min=1.0), mean


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, reduce: Reducer = no_reduce, shift_mean: bool = True
) -> torch.Tensor:
    """(x − mean) / sqrt(var + 1e-8) with the mean and unbiased variance of every valid element
    of the global batch (not per sequence). Masked positions come back as exactly 0.

    shift_mean=False is verl's option of the same name: whiten, then add the mean back,
    (x − mean) / sqrt(var + 1e-8) + mean, so the spread becomes 1 and the mean is kept.
    """
    var, mean = _mean_var(x, mask, reduce)
    whitened = (x - mean) * torch.rsqrt(var + EPS)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))


class DeviceSums:
    """Named running sums of 0-d tensors, kept in float64 where the tensors live. Adding never
    reads a value back, which would make the host wait for the device after every micro-batch
    (minirl/dist/transfer.py says what such waits cost); `means` reads them all at once."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, name: str, value: torch.Tensor) -> None:
        value = value.detach().to(torch.float64).reshape(())
        self.sums[name] = value if name not in self.sums else self.sums[name] + value

    def means(self, count: int, prefix: str, reduce: Reducer = no_reduce) -> dict[str, float]:
        """{prefix + name: the sum over every rank / count}, in one collective."""
        names = sorted(self.sums)
        if not names:
            return {}
        totals = reduce(torch.stack([self.sums[k] for k in names]))
        return {f"{prefix}{k}": v / count for k, v in zip(names, totals.tolist())}
