"""Prefill attention: causal attention within each packed prompt, read from the fused qkv rows.

Both implementations are backends of minirl's varlen core (minirl/models/varlen.py), which the
trainer's packed forwards use too: the reference is exact per-sequence SDPA, the fast one torch's
varlen flash attention (CUDA, half precision), with grouped KV heads handled as the installed
torch allows. Decode attention, which reads the paged KV cache, is paged_attention.py.

Shape legend: N packed tokens, H query heads, Hk KV heads, D head dim.
"""

from __future__ import annotations

import torch

from minirl.kernels.selfcheck import expect_near
from minirl.models.varlen import varlen_attention
from minirl_plugins.engines.native.layers.meta import StepMeta


def split_qkv(qkv_N, heads: int, kv_heads: int, head_dim: int):
    """Views q [N, H, D], k and v [N, Hk, D] of the fused projection's rows [N, (H + 2Hk)·D]."""
    n = qkv_N.shape[0]
    q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
    return (
        qkv_N[:, :q_end].view(n, heads, head_dim),
        qkv_N[:, q_end:k_end].view(n, kv_heads, head_dim),
        qkv_N[:, k_end:].view(n, kv_heads, head_dim),
    )


def prefill_attention(qkv, meta: StepMeta, heads, kv_heads, head_dim, scale, backend: str = "sdpa"):
    """[N, H·D]: each sequence of meta.cu_seqlens_S1 attends causally to itself."""
    q, k, v = split_qkv(qkv, heads, kv_heads, head_dim)
    if backend != "sdpa":  # the flash kernels read dense tensors
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = varlen_attention(q, k, v, meta.cu_seqlens_S1, meta.max_seqlen, scale, backend)
    return out.reshape(-1, heads * head_dim)


def prefill_attention_varlen(qkv, meta: StepMeta, heads, kv_heads, head_dim, scale):
    """prefill_attention through torch's varlen flash attention (torch >= 2.10)."""
    return prefill_attention(qkv, meta, heads, kv_heads, head_dim, scale, backend="torch")


def check_prefill_attention(fn, device, dtype, kv_dtype=None) -> None:
    lens = [5, 130, 1, 64]
    h, hk, d = 12, 2, 128
    qkv = torch.randn(sum(lens), (h + 2 * hk) * d, device=device, dtype=dtype)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)
    meta = StepMeta(True, cu, None, cu_seqlens_S1=cu, max_seqlen=max(lens))
    got, want = fn(qkv, meta, h, hk, d, d**-0.5), prefill_attention(qkv, meta, h, hk, d, d**-0.5)
    expect_near(got, want, dtype, "prefill_attention")
