"""Built-in KL estimators (table in docs/algorithms.md §3), selected by actor.kl_loss_type and
algorithm.kl_penalty. The per-token ones take (logp, ref_logp) of the sampled tokens; a trailing
"+" (k1+, k3+, …) keeps the named estimator's value but takes k2's gradient (straight-through).
`full` is exact over the whole vocabulary and needs the reference's logits at update time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from minirl import hookimpl

K3_EXP_CLAMP = 20.0  # exp(20) ≈ 5e8: beyond this the estimate is noise, and exp would overflow
K3_OUT_CLAMP = 10.0


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = d = logp − ref_logp."""
    return logp - ref_logp


def kl_abs(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """|d|."""
    return (logp - ref_logp).abs()


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = ½·d²."""
    return 0.5 * (logp - ref_logp).square()


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = exp(x) − x − 1 with x = clamp(ref_logp − logp, −20, 20), clamped to [−10, 10]."""
    x = (ref_logp - logp).clamp(-K3_EXP_CLAMP, K3_EXP_CLAMP)
    return (torch.exp(x) - x - 1.0).clamp(-K3_OUT_CLAMP, K3_OUT_CLAMP)


@dataclass(frozen=True)
class StraightThrough:
    """Forward value of `estimator`, gradient of k2: value + (k2 − stopgrad(k2)).

    Written as stopgrad(value) + (k2 − stopgrad(k2)) so the forward is bit-identical to the
    named estimator (k2 − stopgrad(k2) is exactly 0).
    """

    estimator: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def __call__(self, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
        k2 = kl_k2(logp, ref_logp)
        return self.estimator(logp, ref_logp).detach() + (k2 - k2.detach())


def _full_kl_chunk(logits_nV: torch.Tensor, ref_logits_nV: torch.Tensor) -> torch.Tensor:
    logp_nV = torch.log_softmax(logits_nV.float(), dim=-1)
    ref_logp_nV = torch.log_softmax(ref_logits_nV.float(), dim=-1)
    return (logp_nV.exp() * (logp_nV - ref_logp_nV)).sum(-1)


@dataclass(frozen=True)
class FullKL:
    """Exact KL(π‖π_ref) per position from temperature-scaled logits, float32.

    Called as f(logits_NV, ref_logits_NV) -> kl_N (needs_logits = True tells the trainer).
    Positions are processed chunk_size at a time, each chunk under activation checkpointing when
    gradients are on, so the float32 softmax intermediates of only one chunk exist at a time.
    The reference is frozen: its logits are detached.
    """

    chunk_size: int = 1024
    needs_logits: bool = True

    def __call__(self, logits_NV: torch.Tensor, ref_logits_NV: torch.Tensor) -> torch.Tensor:
        pairs = zip(logits_NV.split(self.chunk_size), ref_logits_NV.detach().split(self.chunk_size))
        if torch.is_grad_enabled() and logits_NV.requires_grad:
            chunks = [checkpoint(_full_kl_chunk, x, ref, use_reentrant=False) for x, ref in pairs]
        else:
            chunks = [_full_kl_chunk(x, ref) for x, ref in pairs]
        return torch.cat(chunks) if chunks else logits_NV.new_zeros(0, dtype=torch.float32)


@hookimpl
def minirl_kl_estimators() -> dict:
    named = {
        "k1": kl_k1,
        "kl": kl_k1,
        "abs": kl_abs,
        "k2": kl_k2,
        "mse": kl_k2,
        "k3": kl_k3,
        "low_var_kl": kl_k3,
    }
    straight_through = {f"{name}+": StraightThrough(fn) for name, fn in named.items()}
    return {**named, **straight_through, "full": FullKL()}
