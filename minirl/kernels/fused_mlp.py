"""The Triton kernel behind minirl.models.fused_mlp (imported only when it runs: triton is optional).

One program computes one [BM, BN] tile of silu(x Wgᵀ) · (x Wuᵀ): for each K block it loads the x
tile once and the matching rows of Wg and Wu, and accumulates both products in float32. Tiles are
visited in groups of GROUP_M row tiles per column tile, so a column tile of the weights is read
from L2 by the whole group. Loads and the store go through TMA descriptors, which clip the last
row tile at M.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def silu_mul_rounded(acc_g, acc_u):
    """silu(g)·u rounded as eager bf16 rounds it: g, u to bf16; silu in float32 to bf16; product."""
    g = acc_g.to(tl.bfloat16).to(tl.float32)
    u = acc_u.to(tl.bfloat16).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(tl.bfloat16).to(tl.float32)
    return (s * u).to(tl.bfloat16)


@triton.jit
def grouped_tile(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    num_m = tl.cdiv(M, BM)
    per_group = GROUP_M * tl.cdiv(N, BN)
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit
def gate_up_silu_kernel(
    x_desc,
    wg_desc,
    wu_desc,
    out_desc,
    M,
    N,
    K: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    off_m = pid_m * BM
    off_n = pid_n * BN
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for i in range(K // BK):  # K % BK == 0 (checked by the caller)
        a = x_desc.load([off_m, i * BK])
        acc_g = tl.dot(a, wg_desc.load([off_n, i * BK]).T, acc_g)
        acc_u = tl.dot(a, wu_desc.load([off_n, i * BK]).T, acc_u)
    out_desc.store([off_m, off_n], silu_mul_rounded(acc_g, acc_u))


def launch(x, wg, wu, bm: int, bn: int, bk: int, group_m: int, warps: int, stages: int):
    """silu(x Wgᵀ) · (x Wuᵀ) with the given tiling (see fused_mlp for the tiling it uses)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x.shape
    n = wg.shape[0]
    out = x.new_empty(m, n)
    descriptors = (
        TensorDescriptor.from_tensor(x, [bm, bk]),
        TensorDescriptor.from_tensor(wg, [bn, bk]),
        TensorDescriptor.from_tensor(wu, [bn, bk]),
        TensorDescriptor.from_tensor(out, [bm, bn]),
    )
    grid = (triton.cdiv(m, bm) * (n // bn),)
    gate_up_silu_kernel[grid](*descriptors, m, n, k, bm, bn, bk, group_m, num_warps=warps, num_stages=stages)
    return out
