"""SiLU·mul of the fused gate/up projection: the torch reference and its Triton kernel.

The kernel rounds as eager torch does: silu in float32 rounded to the model dtype, then the
product in float32 rounded again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minirl.kernels.selfcheck import expect_near
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
