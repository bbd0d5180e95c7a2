"""RMSNorm, alone and after the residual add: the torch reference and one Triton kernel for both.

Rounding follows transformers: the norm in float32, rounded to the model dtype, then scaled by the
weight. The fused form also writes x + residual back into the residual (in the model dtype), so a
decoder layer is one kernel per norm.

With rollout.quantization = "fp8" the same kernel also takes x as an fp8 GEMM left it, before its
row scales (x · scale, rounded to the model dtype, is the GEMM's output), and hands the next GEMM
its input quantized by rows (fp8_linear.quantize_rows): rmsnorm_rows.
"""

from __future__ import annotations

import torch

from minirl.kernels.selfcheck import expect_near
from minirl_plugins.engines.native.layers.fp8_linear import E4M3, _store_row_e4m3, expect_rows_near, quantize_rows
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
    xs_ptr,
    s_ptr,
    n_cols,
    stride_x,
    stride_r,
    stride_y,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    X_SCALE: tl.constexpr,
    QUANT: tl.constexpr,
):
    """X_SCALE: x <- x · xs[row] in the model dtype first (an fp8 GEMM's output); QUANT: y is
    stored by rows in e4m3 with its scale in s[row] (fp8_linear.quantize_rows)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if X_SCALE:
        x = (x.to(tl.float32) * tl.load(xs_ptr + row)).to(x.dtype)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(r_ptr + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (xf * rstd).to(x.dtype).to(tl.float32) * w
    if QUANT:
        _store_row_e4m3(y.to(x.dtype).to(tl.float32), y_ptr + row * stride_y + cols, s_ptr + row, mask)
    else:
        tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def rmsnorm_triton(x, weight, eps, residual=None) -> torch.Tensor:
    """One program per row of x viewed as [rows, last dim]; with a residual (x's shape), first
    residual <- x + residual in place, and the norm of that."""
    return _launch(x, weight, eps, residual, None, False)


def _launch(x, weight, eps, residual, x_scale, quant: bool):
    """y (model dtype), or (q, s) with quant: y in e4m3 by rows and its scales [rows, 1]."""
    x2 = x.view(-1, x.shape[-1])
    y2 = torch.empty(x2.shape, dtype=E4M3 if quant else x.dtype, device=x.device)
    s = torch.empty(x2.shape[0], 1, dtype=torch.float32, device=x.device) if quant else None
    r2 = x2 if residual is None else residual.view(-1, x.shape[-1])  # a dummy pointer when absent
    strides = (x2.stride(0), r2.stride(0), y2.stride(0))
    _rmsnorm_kernel[(x2.shape[0],)](
        x2,
        r2,
        weight,
        y2,
        x2 if x_scale is None else x_scale,  # dummy pointers when absent
        y2 if s is None else s,
        x2.shape[1],
        *strides,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=triton.next_power_of_2(x2.shape[1]),
        X_SCALE=x_scale is not None,
        QUANT=quant,
    )
    return (y2, s) if quant else y2.view(x.shape)


def add_rmsnorm_triton(x, residual, weight, eps):
    """In place: residual <- x + residual; returns (rmsnorm(residual), residual)."""
    return rmsnorm_triton(x, weight, eps, residual), residual


def rmsnorm_rows(x, weight, eps, residual=None, x_scale=None, quant=False):
    """rollout.quantization = "fp8": (out, residual). With a residual: x · x_scale [N, 1]
    (rounded to x's dtype; x as an fp8 GEMM left it) when given, residual <- x + residual and
    the norm of that (add_rmsnorm); without one (the embeddings, no scales): the norm of x, and x
    as the residual. out: the norm, or with quant its rows in e4m3 and their scales
    (fp8_linear.quantize_rows)."""
    if residual is None:
        assert x_scale is None, "row scales come with a residual (a GEMM's output is added to it)"
        y, residual = rmsnorm(x, weight, eps), x
    else:
        if x_scale is not None:
            x = (x.float() * x_scale).to(x.dtype)
        y, residual = add_rmsnorm(x, residual, weight, eps)
    return (quantize_rows(y) if quant else y), residual


def rmsnorm_rows_triton(x, weight, eps, residual=None, x_scale=None, quant=False):
    """rmsnorm_rows in one kernel; the residual is updated in place."""
    assert residual is not None or x_scale is None, "row scales come with a residual"
    return _launch(x, weight, eps, residual, x_scale, quant), (x if residual is None else residual)


def check_rmsnorm(fn, device, dtype, kv_dtype=None) -> None:
    x, _, w = _inputs(device, dtype)
    expect_near(fn(x, w, 1e-6), rmsnorm(x, w, 1e-6), dtype, "rmsnorm")


def check_add_rmsnorm(fn, device, dtype, kv_dtype=None) -> None:
    x, r, w = _inputs(device, dtype)
    y, r2 = fn(x, r.clone(), w, 1e-6)
    y_ref, r_ref = add_rmsnorm(x, r, w, 1e-6)
    expect_near(r2, r_ref, dtype, "residual")
    expect_near(y, y_ref, dtype, "rmsnorm")


def check_rmsnorm_rows(fn, device, dtype, kv_dtype=None) -> None:
    """Each form the fp8 decoder uses: the first layer's (no residual), the residual add of an fp8
    GEMM's output (its row scales) into e4m3 rows, and the final norm (scales, model dtype out)."""
    x, r, w = _inputs(device, dtype)
    xs = torch.rand(x.shape[0], 1, device=device) + 0.5
    for residual, x_scale, quant in ((None, None, True), (r, xs, True), (r, xs, False)):
        got = fn(x, w, 1e-6, None if residual is None else residual.clone(), x_scale, quant)
        want = rmsnorm_rows(x, w, 1e-6, residual, x_scale, quant)
        expect_near(got[1], want[1], dtype, "rmsnorm_rows residual")
        if quant:
            expect_rows_near(got[0], want[0], dtype, "rmsnorm_rows")
        else:
            expect_near(got[0], want[0], dtype, "rmsnorm_rows")


def _inputs(device, dtype):
    x = torch.randn(37, 200, device=device, dtype=dtype)
    return x, torch.randn_like(x), torch.rand(200, device=device, dtype=dtype) + 0.5
