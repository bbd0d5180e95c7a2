"""The varlen core: causal attention within each of the packed sequences of one row, by backend.

minirl.models.attention calls `varlen_attention` for every packed forward, sequence parallelism
(plugins/parallel/ulysses.py) wraps it, and the native engine's prefill names a backend.

Shape legend: N packed tokens, S sequences, H query heads, K key/value heads, D head dim.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch
import torch.nn.functional as F

FLASH_DTYPES = (torch.float16, torch.bfloat16)  # the only dtypes the "flash_attn" and "torch" backends take


def varlen_attention(
    q: torch.Tensor,  # [N, H, D]
    k: torch.Tensor,  # [N, K, D]
    v: torch.Tensor,  # [N, K, D]
    cu_seqlens: torch.Tensor,  # [S+1] int32 boundaries
    max_seqlen: int,
    scale: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Causal attention within each of S packed sequences; returns [N, H, D].

    backend: "flash_attn" (flash-attn's varlen kernel), "torch" (torch's varlen attention), both
    CUDA and half precision only, or "sdpa" (exact per-segment SDPA); None: the first available.
    """
    name = backend or _pick_backend(q)
    if name not in _BACKENDS:
        raise ValueError(f"unknown varlen attention backend {name!r}; choose one of {sorted(_BACKENDS)}")
    cu_S1 = cu_seqlens.to(device=q.device, dtype=torch.int32)  # what the kernels take
    return _BACKENDS[name](q, k, v, cu_S1, max_seqlen, scale)


def _pick_backend(q: torch.Tensor) -> str:
    if q.is_cuda and q.dtype in FLASH_DTYPES:
        return "flash_attn" if _flash_attn_varlen() is not None else "torch"
    return "sdpa"


def _flash_varlen(q, k, v, cu, max_seqlen, scale):
    fn = _flash_attn_varlen()
    if fn is None:
        raise ValueError("varlen backend 'flash_attn' needs the flash-attn package: pip install 'minirl[flash-attn]'")
    # flash-attn handles GQA natively (K divides H), so keys and values are not repeated.
    return fn(q, k, v, cu, cu, max_seqlen, max_seqlen, dropout_p=0.0, softmax_scale=scale, causal=True)


def _torch_varlen_attn(q, k, v, cu, max_seqlen, scale):
    fn = _torch_varlen()
    kwargs: dict = {"scale": scale, "window_size": (-1, 0)}  # (-1, 0): causal
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in inspect.signature(fn).parameters:
            kwargs["enable_gqa"] = True
        elif q.is_cuda:
            return _aten_flash_gqa(q, k, v, cu, max_seqlen, scale)
        else:
            k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    return fn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)


def _aten_flash_gqa(q, k, v, cu, max_seqlen, scale):
    """The flash kernel torch's varlen_attn runs, which takes fewer key/value heads than query
    heads. torch 2.11's varlen_attn has no enable_gqa, and repeating the keys and values is a
    strided copy: 4% of a compiled layer's forward on 30k tokens (docs/benchmarks-history.md)."""
    flash = torch.ops.aten._flash_attention_forward
    return flash(q, k, v, cu, cu, max_seqlen, max_seqlen, 0.0, True, False, scale=scale)[0]


def _segment_sdpa(q, k, v, cu_seqlens, max_seqlen, scale):
    """Exact: one causal SDPA per sequence (the CPU path, and the GPU kernels' reference). One
    host sync (the boundaries) per call."""
    bounds = cu_seqlens.tolist()
    q_HND = q.transpose(0, 1)
    k_HND = repeat_kv(k, q.shape[1]).transpose(0, 1)
    v_HND = repeat_kv(v, q.shape[1]).transpose(0, 1)
    outs = [
        F.scaled_dot_product_attention(q_HND[:, s:e], k_HND[:, s:e], v_HND[:, s:e], is_causal=True, scale=scale)
        for s, e in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(outs, dim=1).transpose(0, 1)


_BACKENDS: dict[str, Callable] = {
    "flash_attn": _flash_varlen,
    "torch": _torch_varlen_attn,
    "sdpa": _segment_sdpa,
}


@functools.lru_cache(maxsize=1)
def _flash_attn_varlen() -> Callable | None:
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # not installed, or built against another torch (undefined symbols)
        return None
    return flash_attn_varlen_func


def _torch_varlen() -> Callable:
    from torch.nn.attention.varlen import varlen_attn  # torch >= 2.11, as minirl requires

    return varlen_attn


def repeat_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """GQA on [N, K, D] or [B, K, L, D]: query head h reads key/value head h // (H // K), as in HF."""
    groups = num_heads // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)
