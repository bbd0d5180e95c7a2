"""SiLU·mul of the fused gate/up projection: the torch reference and its Triton kernel.

The kernel rounds as eager torch does: silu in float32 rounded to the model dtype, then the
product in float32 rounded again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minirl.kernels.selfcheck import expect_near
from minirl.models.fused_mlp import operands_fit
from minirl_plugins.engines.native.layers.fp8_linear import (
    E4M3,
    _store_row_e4m3,
    _warps,
    expect_rows_near,
    quantize_rows,
)
from minirl_plugins.engines.native.layers.jit import jit, tl, triton


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2I] (gate, then up) -> silu(gate) * up [N, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@jit
def _silu_mul_kernel(gu_ptr, y_ptr, n_cols, stride_gu, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + n_cols + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (act * u.to(tl.float32)).to(g.dtype), mask=mask)


def silu_mul_triton(gate_up):
    n, two_i = gate_up.shape
    y = torch.empty(n, two_i // 2, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(n, triton.cdiv(two_i // 2, block))](
        gate_up, y, two_i // 2, gate_up.stride(0), y.stride(0), BLOCK=block
    )
    return y


def check_silu_mul(fn, device, dtype, kv_dtype=None) -> None:
    gu = torch.randn(19, 2 * 1500, device=device, dtype=dtype)
    expect_near(fn(gu), silu_mul(gu), dtype, "silu_mul")


def silu_mul_rows(gate_up_scaled: torch.Tensor, scale_N1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rollout.quantization = "fp8": the gate/up GEMM's output before its row scales in; SiLU·mul
    of gate_up · scale (rounded to its dtype, the GEMM's output) out, quantized by rows for down."""
    gate_up = (gate_up_scaled.float() * scale_N1).to(gate_up_scaled.dtype)
    return quantize_rows(silu_mul(gate_up))


@jit
def _silu_mul_rows_kernel(gu_ptr, xs_ptr, q_ptr, s_ptr, n_cols, stride_gu, stride_q, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    xs = tl.load(xs_ptr + row)
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + n_cols + cols, mask=mask, other=0.0)
    dt = g.dtype
    gf = (g.to(tl.float32) * xs).to(dt).to(tl.float32)
    uf = (u.to(tl.float32) * xs).to(dt).to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(dt).to(tl.float32)
    h = (act * uf).to(dt).to(tl.float32)
    _store_row_e4m3(h, q_ptr + row * stride_q + cols, s_ptr + row, mask)


def silu_mul_rows_triton(gate_up_scaled, scale_N1):
    """silu_mul_rows, one program per row (its amax needs the whole row)."""
    n, two_i = gate_up_scaled.shape
    q = torch.empty(n, two_i // 2, dtype=E4M3, device=gate_up_scaled.device)
    s = torch.empty(n, 1, dtype=torch.float32, device=gate_up_scaled.device)
    block = triton.next_power_of_2(two_i // 2)
    _silu_mul_rows_kernel[(n,)](
        gate_up_scaled,
        scale_N1,
        q,
        s,
        two_i // 2,
        gate_up_scaled.stride(0),
        q.stride(0),
        BLOCK=block,
        num_warps=_warps(block),
    )
    return q, s


def check_silu_mul_rows(fn, device, dtype, kv_dtype=None) -> None:
    gu = torch.randn(19, 2 * 1500, device=device, dtype=dtype) * 50
    s = torch.rand(19, 1, device=device) * 0.1
    expect_rows_near(fn(gu, s), silu_mul_rows(gu, s), dtype, "silu_mul_rows")


# The gate/up GEMM with SiLU·mul in its epilogue (minirl/kernels/fused_mlp.py, the kernel the
# trainer's gradient-free passes run under model.fused_mlp): one kernel writes silu(g)·u where
# cuBLAS wrote [N, 2I] and silu_mul read it back. Only for decode steps of up to GATE_UP_ROWS rows,
# where it paid on an H100 at the 1.5B shape (docs/benchmarks.md, "The gate/up GEMM with SiLU·mul
# in the engine"): 23.1 against the pair's 26.3 µs at 64 rows, and the long-context workload's
# decode 0.7% faster. At 128 rows it won alone (24.5 against 27.9 µs) but w1's decode ran 1.4%
# slower with it, and at 256 it lost (36.2 against 31.3). Its tiling, the sweep's best at 64 rows:
# (block_m, block_n, block_k, group_m, warps, stages).
GATE_UP_ROWS = 64
GATE_UP_TILING = (64, 64, 64, 8, 4, 4)


def gate_up_silu(x_NE: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(x W_gateᵀ)·(x W_upᵀ) for the fused [2I, E] weight (gate rows, then up): [N, I]."""
    return silu_mul(F.linear(x_NE, weight))


def gate_up_silu_fits(x_NE: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether gate_up_silu_triton takes these operands: 1 to GATE_UP_ROWS rows, no bias, and
    operands the kernel's tiling fits (minirl.models.fused_mlp.operands_fit). Shapes and dtypes
    only, so a CUDA graph (one per batch size) replays the path it was captured with."""
    _, bn, bk, *_ = GATE_UP_TILING
    i = weight.shape[0] // 2
    return x_NE.shape[0] <= GATE_UP_ROWS and bias is None and operands_fit(x_NE, weight[:i], weight[i:], bn, bk)


def gate_up_silu_triton(x_NE: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """gate_up_silu in one kernel (compute capability 9.0: TMA), for operands gate_up_silu_fits."""
    from minirl.kernels.fused_mlp import launch

    i = weight.shape[0] // 2
    return launch(x_NE, weight[:i], weight[i:], *GATE_UP_TILING)


def check_gate_up_silu(fn, device, dtype, kv_dtype=None) -> None:
    """Row counts from one to GATE_UP_ROWS (one 64-row tile), odd ones included. The kernel rounds
    to bf16 whatever its operands (it is chosen for bf16 engines only)."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(2 * 256, 128, generator=gen) * 128**-0.5).to(device, dtype)
    for rows in (1, 5, 37, GATE_UP_ROWS):
        x = torch.randn(rows, 128, generator=gen).to(device, dtype)
        expect_near(fn(x, weight), gate_up_silu(x, weight), torch.bfloat16, f"gate_up_silu, {rows} rows")
