"""The varlen core: causal attention within each of the packed sequences of one row, by backend.

minirl.models.attention calls `varlen_attention` for every packed forward, sequence parallelism
(plugins/parallel/ulysses.py) wraps it, and the native engine's prefill names a backend.

Shape legend: N packed tokens, S sequences, H query heads, K key/value heads, D head dim.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Callable

import torch
import torch.nn.functional as F

FLASH_DTYPES = (torch.float16, torch.bfloat16)  # the only dtypes the "flash_attn" and "torch" backends take
# The "torch" backend runs every sequence of at least this many tokens through cuDNN's dense causal
# attention (SDPA's cuDNN backend), one sequence at a time, and the shorter ones through the flash
# kernel: at 27.7k tokens on an H200 cuDNN runs 652 TFLOP/s forward and 587 forward + backward,
# the flash kernel 336 and 314 (dev/bench_long_context.py, docs/benchmarks.md "Long context").
# 0 turns the cuDNN path off.
LONG_SEQUENCE = 4096


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
    With either CUDA backend, sequences of LONG_SEQUENCE tokens or more run through cuDNN.
    """
    name = backend or _pick_backend(q)
    if name not in _BACKENDS:
        raise ValueError(f"unknown varlen attention backend {name!r}; choose one of {sorted(_BACKENDS)}")
    cu_S1 = cu_seqlens.to(device=q.device, dtype=torch.int32)  # what the kernels take
    kernel = _BACKENDS[name]
    if name != "sdpa" and 0 < LONG_SEQUENCE <= max_seqlen and _cudnn_usable(q, k):
        return _by_length(q, k, v, cu_S1, scale, _cudnn_causal, kernel)
    return kernel(q, k, v, cu_S1, max_seqlen, scale)


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


def _by_length(q, k, v, cu, scale, long_fn, short_fn):
    """Each sequence of at least LONG_SEQUENCE tokens through long_fn(q, k, v, scale) alone, each
    run of consecutive shorter ones through short_fn(q, k, v, cu, max_seqlen, scale) together;
    outputs in packed order. One host read of the boundaries, unless the row is one sequence."""
    if cu.numel() == 2:
        return long_fn(q, k, v, scale)
    bounds = cu.tolist()
    outs, run = [], []  # run: the boundaries of the short sequences not yet computed
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end - start < LONG_SEQUENCE:
            run = run or [start]
            run.append(end)
            continue
        outs += _short_run(q, k, v, run, scale, short_fn)
        outs.append(long_fn(q[start:end], k[start:end], v[start:end], scale))
        run = []
    outs += _short_run(q, k, v, run, scale, short_fn)
    return torch.cat(outs)


def _short_run(q, k, v, run: list[int], scale, short_fn) -> list[torch.Tensor]:
    if not run:
        return []
    s, e = run[0], run[-1]
    cu = torch.tensor([b - s for b in run], dtype=torch.int32).to(q.device, non_blocking=True)
    longest = max(b - a for a, b in zip(run[:-1], run[1:]))
    return [short_fn(q[s:e], k[s:e], v[s:e], cu, longest, scale)]


def _cudnn_causal(q, k, v, scale):
    """One sequence [n, H, D] through SDPA's cuDNN kernel, the key/value heads unrepeated."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q_1HnD, k_1KnD, v_1KnD = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(
            q_1HnD, k_1KnD, v_1KnD, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
        )
    return out[0].transpose(0, 1)


@functools.cache
def _cudnn_works(device: str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """cuDNN's attention runs this shape on `device` and agrees with the flash kernel on a small
    sequence, forward and backward; else a warning, and the flash kernel takes every length."""
    gen = torch.Generator(device=device).manual_seed(0)
    n = 300
    q, k, v = (
        torch.randn(n, h, head_dim, device=device, dtype=dtype, generator=gen).requires_grad_()
        for h in (heads, kv_heads, kv_heads)
    )
    g = torch.randn(n, heads, head_dim, device=device, dtype=dtype, generator=gen)
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    try:
        got = [_cudnn_causal(q, k, v, head_dim**-0.5)]
        got += torch.autograd.grad(got[0], (q, k, v), g)
        want = [_torch_varlen_attn(q, k, v, cu, n, head_dim**-0.5)]
        want += torch.autograd.grad(want[0], (q, k, v), g)
        problem = next((f"differs by {e:.1e}" for a, b in zip(got, want) if (e := _rel_err(a, b)) > 2e-2), None)
    except RuntimeError as exc:  # no cuDNN, or it refuses the shape
        problem = f"fails ({str(exc).splitlines()[0][:200]})"
    if problem is not None:
        warnings.warn(f"cuDNN attention {problem}; sequences of any length use the flash kernel")
    return problem is None


def _cudnn_usable(q: torch.Tensor, k: torch.Tensor) -> bool:
    if not q.is_cuda or q.dtype not in FLASH_DTYPES:
        return False
    return isolated(_cudnn_works, str(q.device), q.dtype, q.shape[1], k.shape[1], q.shape[2])


def isolated(fn, *args):
    """fn(*args) with gradients on and saved-tensor hooks of its own: a one-time check that runs a
    backward may be first called inside a forward under activation checkpointing, whose hooks
    would count what the check saves as the layer's, and the recomputed forward (no check then)
    would not match."""
    identity = (lambda x: x, lambda x: x)
    with torch.inference_mode(False), torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(*identity):
        return fn(*args)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm().clamp_min(1e-30))


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
