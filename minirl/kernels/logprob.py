"""Fused log-softmax + entropy over a logits chunk in Triton: no float32 [n, V] tensor ever exists.

The lm_head GEMM stays in cuBLAS and writes the logits chunk z [n, V] in its dtype; one kernel
streams each row once (an online max, two rescaled running sums), one kernel writes grad_z once,
where the plain path (`logprob._chunk_stats`) makes about ten float32 vocabulary-sized passes.
The math of both kernels is in docs/architecture.md ("The fused log-prob head"). A label outside
[0, V) gives a NaN log-prob instead of reading out of bounds; logits / T must be finite and above
−1e30 (the running max's start).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FWD_BLOCK = 4096  # columns per step of a row's streaming pass
FWD_WARPS = 8
BWD_BLOCK = 4096  # columns per backward program (grid: rows × column blocks)
BWD_WARPS = 8


@triton.jit
def _fwd_kernel(
    z_ptr,
    labels_ptr,
    logp_ptr,
    ent_ptr,
    m_ptr,
    ld_ptr,
    V,
    stride_z,
    inv_t,
    WITH_ENTROPY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * stride_z
    cols = tl.arange(0, BLOCK)
    # the running max starts finite so that the first rescale is exp(−huge)·0 = 0, not −inf·0 = NaN;
    # only rows whose every logit / T is below −1e30 (none from a real model) would come out wrong
    m = -1e30
    d = 0.0
    a = 0.0
    for start in range(0, V, BLOCK):
        mask = start + cols < V
        s = tl.load(base + start + cols, mask=mask, other=-float("inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(s, axis=0))
        r = tl.exp(m - m_new)
        # floored: exp(t) is 0 in float32 below about −104 anyway, and exp(t)·t is then 0·(−1000)
        # instead of 0·(−inf) = NaN in the masked tail
        t = tl.maximum(s - m_new, -1000.0)
        e = tl.exp(t)
        if WITH_ENTROPY:
            a = r * a + (m - m_new) * (r * d) + tl.sum(e * t, axis=0)
        d = r * d + tl.sum(e, axis=0)
        m = m_new
    ld = tl.log(d)
    y = tl.load(labels_ptr + row)
    ok = (y >= 0) & (y < V)
    s_y = tl.load(base + y, mask=ok, other=float("nan")).to(tl.float32) * inv_t
    tl.store(logp_ptr + row, (s_y - m) - ld)
    tl.store(m_ptr + row, m)
    tl.store(ld_ptr + row, ld)
    if WITH_ENTROPY:
        tl.store(ent_ptr + row, ld - a / d)


@triton.jit
def _bwd_kernel(
    z_ptr,
    labels_ptr,
    m_ptr,
    ld_ptr,
    ent_ptr,
    g_logp_ptr,
    g_ent_ptr,
    gz_ptr,
    V,
    stride_z,
    stride_gz,
    inv_t,
    HAS_G_LOGP: tl.constexpr,
    HAS_G_ENT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    m = tl.load(m_ptr + row)
    ld = tl.load(ld_ptr + row)
    z = tl.load(z_ptr + row * stride_z + cols, mask=mask, other=0.0)
    t = z.to(tl.float32) * inv_t - m  # s − m
    p = tl.exp(t - ld)
    g = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_G_LOGP:
        g_l = tl.load(g_logp_ptr + row)
        y = tl.load(labels_ptr + row)
        g = tl.where(cols == y, g_l, 0.0) - g_l * p
    if HAS_G_ENT:
        g_h = tl.load(g_ent_ptr + row)
        c = ld - tl.load(ent_ptr + row)  # E_p[s] − m
        g = g - g_h * p * (t - c)
    tl.store(gz_ptr + row * stride_gz + cols, (g * inv_t).to(z.dtype), mask=mask)


def _forward(z_nV: torch.Tensor, labels_n: torch.Tensor, inv_t: float, with_entropy: bool):
    n, vocab = z_nV.shape
    stats = torch.empty(4, n, dtype=torch.float32, device=z_nV.device)  # logp, H, m, log d
    if not with_entropy:
        stats[1].zero_()
    if n:
        _fwd_kernel[(n,)](
            z_nV,
            labels_n,
            *stats,  # logp, H, m, log d
            vocab,
            z_nV.stride(0),
            inv_t,
            WITH_ENTROPY=with_entropy,
            BLOCK=min(FWD_BLOCK, triton.next_power_of_2(vocab)),
            num_warps=FWD_WARPS,
        )
    return stats


def _backward(z_nV, labels_n, stats, inv_t, g_logp_n, g_ent_n):
    n, vocab = z_nV.shape
    grad_nV = torch.empty_like(z_nV)
    block = min(BWD_BLOCK, triton.next_power_of_2(vocab))
    if n:
        _bwd_kernel[(n, triton.cdiv(vocab, block))](
            z_nV,
            labels_n,
            stats[2],
            stats[3],
            stats[1],
            stats[0] if g_logp_n is None else g_logp_n,  # a dummy pointer when absent
            stats[0] if g_ent_n is None else g_ent_n,
            grad_nV,
            vocab,
            z_nV.stride(0),
            grad_nV.stride(0),
            inv_t,
            HAS_G_LOGP=g_logp_n is not None,
            HAS_G_ENT=g_ent_n is not None,
            BLOCK=block,
            num_warps=BWD_WARPS,
        )
    return grad_nV


class FusedLogprobEntropy(torch.autograd.Function):
    """(z [n, V], labels [n], T, with_entropy) -> (logp [n], H [n]): log softmax(z / T)[label] and
    the entropy of softmax(z / T) in float32, from z in any float dtype; H is zeros (and not
    differentiable) when with_entropy is False. Saves z itself (no copy) and 16 bytes a row."""

    @staticmethod
    def forward(ctx, z_nV, labels_n, temperature, with_entropy):
        z_nV = z_nV if z_nV.stride(-1) == 1 else z_nV.contiguous()
        labels_n = labels_n.contiguous()
        inv_t = 1.0 / temperature
        stats = _forward(z_nV, labels_n, inv_t, with_entropy)
        ctx.save_for_backward(z_nV, labels_n, stats)
        ctx.inv_t, ctx.with_entropy = inv_t, with_entropy
        ctx.set_materialize_grads(False)
        logp_n, ent_n = stats[0].clone(), stats[1].clone()
        if not with_entropy:
            ctx.mark_non_differentiable(ent_n)
        return logp_n, ent_n

    @staticmethod
    def backward(ctx, g_logp_n, g_ent_n):
        z_nV, labels_n, stats = ctx.saved_tensors
        if not ctx.with_entropy:
            g_ent_n = None
        if g_logp_n is None and g_ent_n is None:
            return None, None, None, None
        g_logp_n = None if g_logp_n is None else g_logp_n.float().contiguous()
        g_ent_n = None if g_ent_n is None else g_ent_n.float().contiguous()
        return _backward(z_nV, labels_n, stats, ctx.inv_t, g_logp_n, g_ent_n), None, None, None


fused_logprob_entropy = FusedLogprobEntropy.apply
