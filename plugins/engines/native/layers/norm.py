"""RMSNorm, alone and after the residual add: the torch reference and one Triton kernel for both.

Rounding follows transformers: the norm in float32, rounded to the model dtype, then scaled by the
weight. The fused form also writes x + residual back into the residual (in the model dtype), so a
decoder layer is one kernel per norm.
"""

from __future__ import annotations

import torch

from minirl.kernels.selfcheck import expect_near
from minirl_plugins.engines.native.layers.jit import jit, tl, triton


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def add_rmsnorm(x, residual, weight, eps):
    """residual <- x + residual; returns (rmsnorm(residual), residual)."""
    residual = x + residual
    return rmsnorm(residual, weight, eps), residual


@jit
def _rmsnorm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    y_ptr,
    n_cols,
    stride_x,
    stride_r,
    stride_y,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(r_ptr + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (xf * rstd).to(x.dtype).to(tl.float32) * w
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def rmsnorm_triton(x, weight, eps, residual=None) -> torch.Tensor:
    """One program per row of x viewed as [rows, last dim]; with a residual (x's shape), first
    residual <- x + residual in place, and the norm of that."""
    y = torch.empty_like(x)
    x2, y2 = x.view(-1, x.shape[-1]), y.view(-1, x.shape[-1])
    r2 = x2 if residual is None else residual.view(-1, x.shape[-1])  # a dummy pointer when absent
    strides = (x2.stride(0), r2.stride(0), y2.stride(0))
    _rmsnorm_kernel[(x2.shape[0],)](
        x2,
        r2,
        weight,
        y2,
        x2.shape[1],
        *strides,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=triton.next_power_of_2(x2.shape[1]),
    )
    return y


def add_rmsnorm_triton(x, residual, weight, eps):
    """In place: residual <- x + residual; returns (rmsnorm(residual), residual)."""
    return rmsnorm_triton(x, weight, eps, residual), residual


def check_rmsnorm(fn, device, dtype, kv_dtype=None) -> None:
    x, _, w = _inputs(device, dtype)
    expect_near(fn(x, w, 1e-6), rmsnorm(x, w, 1e-6), dtype, "rmsnorm")


def check_add_rmsnorm(fn, device, dtype, kv_dtype=None) -> None:
    x, r, w = _inputs(device, dtype)
    y, r2 = fn(x, r.clone(), w, 1e-6)
    y_ref, r_ref = add_rmsnorm(x, r, w, 1e-6)
    expect_near(r2, r_ref, dtype, "residual")
    expect_near(y, y_ref, dtype, "rmsnorm")


def _inputs(device, dtype):
    x = torch.randn(37, 200, device=device, dtype=dtype)
    return x, torch.randn_like(x), torch.rand(200, device=device, dtype=dtype) + 0.5
