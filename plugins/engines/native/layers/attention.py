"""Prefill attention: causal attention within each packed prompt, read from the fused qkv rows.

Both implementations are backends of minirl's varlen core (minirl/models/varlen.py), which the
trainer's packed forwards use too: the exact per-sequence SDPA reference, and torch's varlen flash
attention (CUDA, half precision, torch >= 2.10). Decode attention is paged_attention.py.

Shape legend: N packed tokens, H query heads, Hk KV heads, D head dim.
"""

from __future__ import annotations

import functools

import torch

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
