"""Per-token log-probabilities and entropies from the language-model head, memory-bounded.

The float32 logits of a whole batch are what runs a GPU out of memory in RL training: 16k packed
tokens × 151,936 vocabulary × 4 bytes = 9.7 GB, several times over once autograd keeps the
softmax for backward. `chunked_logprobs` applies the head to a chunk of positions at a time and,
with `recompute=True`, wraps each chunk in activation checkpointing so backward recomputes that
chunk's logits instead of keeping them: the peak is a few chunk × V float32 tensors.

All log-probs are of logits / rollout temperature (docs/algorithms.md), in float32 whatever the
model dtype. A chunk's statistics come from plain PyTorch (`_chunk_stats`, the reference and the
CPU path) or from the fused Triton kernels (minirl/kernels/logprob.py: no float32 [n, V] tensor),
used on CUDA when they pass a check against the plain path. MINIRL_LOGPROB_IMPL = auto | fused |
plain (read at import; or set `logprob.IMPL`, or pass impl=) forces either.

Shape legend: N packed token positions, V vocabulary, H hidden size.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from minirl.kernels.selfcheck import expect_close, self_check

# Positions per output-projection chunk (chunk_size=None). With gradients the chunk bounds the
# memory the loss holds (the plain path keeps float32 copies of it: 2,048 × 151,936 × 4 B = 1.2 GB
# each). Without gradients on the fused kernels a chunk's logits live only in the head's dtype, and
# longer chunks run the head's GEMM a little faster (8,192 × 151,936 bf16 = 2.5 GB;
# docs/benchmarks-history.md).
CHUNK, CHUNK_FUSED_NO_GRAD = 2048, 8192
IMPLS = ("auto", "fused", "plain")
IMPL = os.environ.get("MINIRL_LOGPROB_IMPL", "auto")  # auto: fused on CUDA when its kernels check out


@functools.cache
def fused_works(device: str) -> bool:
    """The fused kernels import, compile and agree with the plain path on a small problem on
    `device` (minirl.kernels.selfcheck, once per device)."""
    problem = self_check(lambda: _check_fused(device), device)
    if problem is not None:
        warnings.warn(f"fused log-prob kernels on {device} {problem}; using the plain torch path")
    return problem is None


def _check_fused(device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    z_nV = (4 * torch.randn(5, 9000, generator=gen)).to(device)  # rows of several blocks
    labels_n = torch.tensor([0, 8999, 3, 4500, 77], device=device)
    got, ref = [], []
    for stats, out in ((_chunk_stats_fused, got), (_chunk_stats, ref)):
        z = z_nV.clone().requires_grad_()
        logp_n, ent_n = stats(z, labels_n, torch.nn.Identity(), 0.7, True)  # the "hidden" states are the logits
        out += [logp_n, ent_n, *torch.autograd.grad(logp_n.sum() - 0.5 * ent_n.sum(), [z])]
    expect_close(got, ref, rtol=1e-4, atol=1e-4, problem="disagree with the plain path")


def use_fused(device: torch.device, impl: str | None = None) -> bool:
    """Whether chunked_logprobs takes the fused Triton path for tensors on `device`."""
    impl = IMPL if impl is None else impl
    if impl not in IMPLS:
        raise ValueError(f"logprob impl = {impl!r} (MINIRL_LOGPROB_IMPL): must be one of {', '.join(IMPLS)}")
    if impl == "auto":
        return device.type == "cuda" and fused_works(str(device))
    return impl == "fused"


def _chunk_stats(
    hidden_nH: torch.Tensor, labels_n: torch.Tensor, head: Callable, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """logp = z[label] − logsumexp(z) and H = logsumexp(z) − Σ softmax(z)·z (docs/algorithms.md §5)
    for z = head(hidden) / T in float32; H needs no log of a probability, so it stays finite where
    softmax underflows to 0."""
    z_nV = head(hidden_nH).float() / temperature
    # Subtracting the row max (both results are invariant to it) keeps logsumexp and Σ p·z small, so
    # their difference does not cancel catastrophically; detached, as its gradient is exactly 0.
    z_nV = z_nV - z_nV.amax(dim=-1, keepdim=True).detach()
    lse_n = torch.logsumexp(z_nV, dim=-1)
    logp_n = z_nV.gather(-1, labels_n.long().unsqueeze(-1)).squeeze(-1) - lse_n  # no [n, V] log-softmax
    if not with_entropy:
        return logp_n, torch.zeros_like(logp_n)
    p_nV = torch.exp(z_nV - lse_n.unsqueeze(-1))
    return logp_n, lse_n - (p_nV * z_nV).sum(-1)


def _chunk_stats_fused(hidden_nH, labels_n, head, temperature, with_entropy) -> tuple[torch.Tensor, torch.Tensor]:
    """_chunk_stats with the softmax math in two Triton kernels; the head's GEMM stays cuBLAS."""
    from minirl.kernels.logprob import fused_logprob_entropy

    return fused_logprob_entropy(head(hidden_nH), labels_n, temperature, with_entropy)


def chunked_logprobs(
    hidden_NH: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    labels_N: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    recompute: bool = True,
    impl: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and optionally entropies) of labels_N under head(hidden_NH) / temperature.

    head: hidden_chunk [n, H] -> logits_chunk [n, V] (an nn.Linear lm_head or a lambda); its
    parameters receive gradients through the closure.
    recompute=True: with gradients, each chunk runs under torch.utils.checkpoint, so backward
    recomputes its logits and keeps only the hidden chunk; False keeps every chunk's float32
    intermediates (as much memory as the unchunked form).
    chunk_size: positions per chunk; None: CHUNK_FUSED_NO_GRAD on the fused path without
    gradients, else CHUNK.
    impl: "auto", "fused", "plain", or None for the module's IMPL (module docstring).
    Returns (logp_N, entropy_N or None), float32.
    """
    if not temperature > 0:
        raise ValueError(
            f"temperature = {temperature!r}: log-probs are of logits / temperature, so it must be "
            "> 0; for greedy rollouts (rollout.temperature = 0) score the tokens at temperature 1"
        )
    fused = use_fused(hidden_NH.device, impl)
    if chunk_size is None:
        chunk_size = CHUNK_FUSED_NO_GRAD if fused and not torch.is_grad_enabled() else CHUNK
    if chunk_size < 1:
        raise ValueError(f"chunk_size = {chunk_size}: must be >= 1 positions")
    stats = _chunk_stats_fused if fused else _chunk_stats
    if recompute and torch.is_grad_enabled():
        stats = functools.partial(checkpoint, stats, use_reentrant=False)
    logps, entropies = [], []
    for start in range(0, hidden_NH.shape[0], chunk_size):
        end = start + chunk_size
        logp_n, ent_n = stats(hidden_NH[start:end], labels_N[start:end], head, temperature, with_entropy)
        logps.append(logp_n)
        entropies.append(ent_n)
    if not logps:  # zero positions: keep the dtype/device contract
        empty_N = hidden_NH.new_zeros(0, dtype=torch.float32)
        return empty_N, (empty_N if with_entropy else None)
    return torch.cat(logps), (torch.cat(entropies) if with_entropy else None)
