"""Prefill attention: causal attention within each packed prompt, read from the fused qkv rows.

Both implementations are backends of minirl's varlen core (minirl/models/varlen.py), which the
trainer's packed forwards use too: the exact per-sequence SDPA reference, and torch's varlen flash
attention (CUDA, half precision, torch >= 2.10). Decode attention is paged_attention.py.

Extend attention is the prefill of a request's next turn: its new tokens attend to the whole
sequence, whose earlier keys and values come from the KV cache (the new ones were just written
there). The reference is a masked SDPA per sequence; on CUDA the flash kernel, whose causal mask
aligns the last query with the last key, as a continuation needs.

Shape legend: N packed tokens, H query heads, Hk KV heads, D head dim.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from minirl.kernels.selfcheck import expect_near
from minirl.models.varlen import varlen_attention
from minirl_plugins.engines.native.layers.meta import Heads, StepMeta


def split_qkv(qkv_N, heads: Heads):
    """Views q [N, H, D], k and v [N, Hk, D] of the fused projection's rows [N, (H + 2Hk)·D]."""
    (n, _), (h, hk, d) = qkv_N.shape, heads
    q, k, v = qkv_N.split([h * d, hk * d, hk * d], dim=-1)
    return q.view(n, h, d), k.view(n, hk, d), v.view(n, hk, d)


def prefill_attention(qkv, meta: StepMeta, heads: Heads, scale: float, backend: str = "sdpa"):
    """[N, H·D]: each sequence of meta.cu_seqlens_S1 attends causally to itself."""
    q, k, v = split_qkv(qkv, heads)
    if backend != "sdpa":  # the flash kernels read dense tensors
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = varlen_attention(q, k, v, meta.cu_seqlens_S1, meta.max_seqlen, scale, backend)
    return out.reshape(-1, heads.num_heads * heads.head_dim)


prefill_attention_varlen = functools.partial(prefill_attention, backend="torch")


def check_prefill_attention(fn, device, dtype, kv_dtype=None) -> None:
    lens = [5, 130, 1, 64]
    heads = Heads(12, 2, 128)
    qkv = torch.randn(sum(lens), (12 + 2 * 2) * 128, device=device, dtype=dtype)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)
    meta = StepMeta(True, cu, None, cu_seqlens_S1=cu, max_seqlen=max(lens))
    got, want = fn(qkv, meta, heads, 128**-0.5), prefill_attention(qkv, meta, heads, 128**-0.5)
    expect_near(got, want, dtype, "prefill_attention")


def extend_attention(qkv, k_cache, v_cache, meta: StepMeta, heads: Heads, scale: float):
    """[N, H·D]: the new tokens of sequence s (queries cu_seqlens_S1[s]:[s+1]) attend to its
    context (ctx_slots_M[cu_ctx_S1[s]:[s+1]], every position up to each query's own)."""
    q, _, _ = split_qkv(qkv, heads)
    k, v = _context(k_cache, v_cache, meta, q.dtype)
    bounds_q, bounds_k = meta.cu_seqlens_S1.tolist(), meta.cu_ctx_S1.tolist()
    outs = []
    for (qs, qe), (ks, ke) in zip(zip(bounds_q, bounds_q[1:]), zip(bounds_k, bounds_k[1:])):
        nq, nk = qe - qs, ke - ks
        visible = torch.arange(nk, device=q.device)[None, :] <= torch.arange(nk - nq, nk, device=q.device)[:, None]
        o = F.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1),
            k[ks:ke].transpose(0, 1),
            v[ks:ke].transpose(0, 1),
            attn_mask=visible,
            scale=scale,
            enable_gqa=heads.num_heads != heads.num_kv_heads,
        )
        outs.append(o.transpose(0, 1))
    return torch.cat(outs).reshape(-1, heads.num_heads * heads.head_dim)


def extend_attention_flash(qkv, k_cache, v_cache, meta: StepMeta, heads: Heads, scale: float):
    """extend_attention with the flash kernel (CUDA, half precision; fewer KV heads allowed)."""
    q, _, _ = split_qkv(qkv, heads)
    k, v = _context(k_cache, v_cache, meta, q.dtype)
    flash = torch.ops.aten._flash_attention_forward
    cu_q, cu_k = meta.cu_seqlens_S1, meta.cu_ctx_S1
    out = flash(q.contiguous(), k, v, cu_q, cu_k, meta.max_seqlen, meta.max_ctx_len, 0.0, True, False, scale=scale)[0]
    return out.reshape(-1, heads.num_heads * heads.head_dim)


def _context(k_cache, v_cache, meta: StepMeta, dtype):
    """The keys and values [M, Hk, D] of every context position, in the compute dtype (an 8-bit
    cache holds them with scale 1)."""
    return k_cache[meta.ctx_slots_M].to(dtype), v_cache[meta.ctx_slots_M].to(dtype)


def check_extend_attention(fn, device, dtype, kv_dtype=None) -> None:
    """Three sequences continuing after 0, 37 and 130 cached positions, against the reference."""
    heads, new, cached = Heads(12, 2, 128), [5, 64, 1], [0, 37, 130]
    kv = torch.randn(2, sum(new) + sum(cached) + 16, 2, 128, device=device).to(kv_dtype or dtype)
    qkv = torch.randn(sum(new), (12 + 2 * 2) * 128, device=device, dtype=dtype)
    ctx = [n + c for n, c in zip(new, cached)]
    perm = torch.randperm(kv.shape[1] - 16, device=device)[: sum(ctx)]  # scattered slots, as pages are
    cu_q = torch.tensor([0, *torch.tensor(new).cumsum(0)], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(ctx).cumsum(0)], dtype=torch.int32, device=device)
    meta = StepMeta(True, perm, None, cu_seqlens_S1=cu_q, max_seqlen=max(new))
    meta.ctx_slots_M, meta.cu_ctx_S1, meta.max_ctx_len = perm, cu_k, max(ctx)
    args = (qkv, kv[0], kv[1], meta, heads, 128**-0.5)
    expect_near(fn(*args), extend_attention(*args), dtype, "extend_attention")
