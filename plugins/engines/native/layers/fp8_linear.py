"""fp8 weights and activations for the engine's linear layers (rollout.quantization = "fp8").

Each quantized matrix (every layer's qkv, o, gate/up and down; the embedding and lm_head stay in
the model dtype, so the logits the sampler draws from are not rounded further) keeps an e4m3 copy
of its weight with one float32 scale (per tensor), written in place from the model-dtype weight
after every load, so CUDA graphs captured over it stay valid. The activations are quantized by
rows, each row with its own scale taken from it (dynamic per-token scaling: a row's result does
not depend on the rows batched with it), by the op that produces them: the norm before qkv and
gate/up (norm.rmsnorm_rows), SiLU·mul before down (activation.silu_mul_rows), and one small
kernel for the attention's output before o (quantize_rows). The GEMM runs on the fp8 tensor
cores with the weight's scale alone (torch._scaled_mm, float32 sums; cuBLASLt's fast per-tensor
path, where its row-scaled kernels are slower than bf16 at decode batches, dev/bench_gemm.py
--fp8), and the op that reads its output applies the row scales: rotary (rotary.rope_store,
with the qkv bias), and the next norm or SiLU·mul as it loads.

    amax = max |x|,  scale = amax / 448,  q = round_to_nearest_even(clamp(x · (448 / amax), ±448))

448 is e4m3's largest finite value. An element keeps 3 mantissa bits: a relative error of at
most 2^-4 down to e4m3's smallest normal (2^-6 · scale), an absolute one of 2^-10 · scale below.
The rollout then samples from a policy a little off the trainer's; truncated importance sampling
corrects for it (on by default with this setting, docs/algorithms.md §5).

The references here run anywhere (tests, CPU): scaled_mm_ref multiplies the dequantized values in
float32, which is what the fp8 GEMM computes up to the order of its float32 sums (each product of
two e4m3 values is exact in float32). Shape legend: N rows (tokens), K input features, O output
features.
"""

from __future__ import annotations

import torch
from torch import nn

from minirl.kernels.selfcheck import Mismatch, expect_near
from minirl_plugins.engines.native.layers.jit import jit, tl, triton

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
TINY = 1e-12  # the amax of an all-zero input: its scale stays finite


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): x's e4m3 values and their float32 scale (a 0-d tensor), x ≈ q · scale."""
    return _e4m3(x, x.abs().amax())


def _e4m3(x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """448 / amax and amax / 448 each one correctly rounded float32 division, as the kernels' div_rn
    (a Python number on either side would make torch multiply by a rounded reciprocal instead)."""
    amax = amax.float().clamp_min(TINY)
    top = torch.full_like(amax, E4M3_MAX)
    return (x.float() * (top / amax)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), amax / top


def quantize_into(x: torch.Tensor, q_out: torch.Tensor, scale_out: torch.Tensor) -> None:
    """quantize(x) written in place: its e4m3 values into q_out (x's shape), its scale into the
    0-d float32 scale_out (an Fp8Weight's buffers, which captured CUDA graphs read)."""
    q, scale = quantize(x)
    q_out.copy_(q)
    scale_out.copy_(scale)


def scaled_mm_ref(q_NK, scale_x, w_OK, scale_w, bias_O, dtype) -> torch.Tensor:
    """(q · scale_x) @ (w · scale_w)^T + bias, summed in float32, rounded to dtype."""
    y = (q_NK.float() @ w_OK.float().t()) * (scale_x * scale_w)
    return (y if bias_O is None else y + bias_O.float()).to(dtype)


def scaled_mm_cuda(q_NK, scale_x, w_OK, scale_w, bias_O, dtype) -> torch.Tensor:
    """The same on the fp8 tensor cores (cuBLASLt; compute capability 8.9 and up)."""
    return torch._scaled_mm(q_NK, w_OK.t(), scale_x, scale_w, bias=bias_O, out_dtype=dtype)


def quantize_rows(x_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale_N1): quantize applied to each row, scales [N, 1] in float32."""
    return _e4m3(x_NK, x_NK.abs().amax(-1, keepdim=True))


def scale_rows(y_NO, scale_N1, bias_O=None) -> torch.Tensor:
    """An fp8 GEMM's output y' (its activations' row scales left out) as the GEMM's result:
    y' · scale (+ bias), in float32, rounded to y's dtype."""
    y = y_NO.float() * scale_N1
    return (y if bias_O is None else y + bias_O.float()).to(y_NO.dtype)


@jit
def _store_e4m3(y, amax, q_ptrs, mask):
    """y (float32) as _e4m3 rounds it on `amax`: scaled by 448 / amax, clamped, stored as e4m3;
    returns the scale amax / 448 (448.0 and 1e-12 are E4M3_MAX and TINY; a Triton kernel reads no
    module globals)."""
    amax = tl.maximum(amax, 1e-12)
    top = tl.full((), 448.0, tl.float32)
    q = tl.minimum(tl.maximum(y * tl.div_rn(top, amax), -448.0), 448.0)
    tl.store(q_ptrs, q.to(q_ptrs.dtype.element_ty), mask=mask)
    return tl.div_rn(amax, top)


@jit
def _store_row_e4m3(y, q_ptrs, s_ptr, mask):
    """One row y (float32, masked lanes 0) as quantize_rows stores it: e4m3 values and the scale."""
    tl.store(s_ptr, _store_e4m3(y, tl.max(tl.abs(y), axis=0), q_ptrs, mask))


@jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, n_cols, stride_x, stride_q, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    _store_row_e4m3(x, q_ptr + row * stride_q + cols, s_ptr + row, mask)


def quantize_rows_triton(x_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows, one program per row."""
    q = torch.empty(x_NK.shape, dtype=E4M3, device=x_NK.device)
    s = torch.empty(x_NK.shape[0], 1, dtype=torch.float32, device=x_NK.device)
    block = triton.next_power_of_2(x_NK.shape[1])
    _quantize_rows_kernel[(x_NK.shape[0],)](
        x_NK, q, s, x_NK.shape[1], x_NK.stride(0), q.stride(0), BLOCK=block, num_warps=_warps(block)
    )
    return q, s


@jit
def _quantize_into_kernel(x_ptr, amax_ptr, q_ptr, s_ptr, n, BLOCK: tl.constexpr):
    """One block of x stored as _e4m3 stores it, on the whole tensor's amax; the first program
    also stores the scale."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    scale = _store_e4m3(x, tl.load(amax_ptr).to(tl.float32), q_ptr + offs, mask)
    if pid == 0:
        tl.store(s_ptr, scale)


QUANTIZE_BLOCK = 8192


def quantize_into_triton(x: torch.Tensor, q_out: torch.Tensor, scale_out: torch.Tensor) -> None:
    """quantize_into in two passes over x (contiguous): one reduction for its largest magnitude
    (read in place, no |x| or float32 copy), then one kernel that scales, rounds and stores; about
    5 bytes moved an element where quantize's chain of eager ops moves 30."""
    if not (x.is_contiguous() and q_out.is_contiguous()):
        return quantize_into(x, q_out, scale_out)
    amax = torch.linalg.vector_norm(x, float("inf"))
    grid = (triton.cdiv(x.numel(), QUANTIZE_BLOCK),)
    _quantize_into_kernel[grid](x, amax, q_out, scale_out, x.numel(), BLOCK=QUANTIZE_BLOCK, num_warps=8)


def _warps(block: int) -> int:
    """Warps for a program holding one row of `block` lanes: about 32 lanes a thread."""
    return max(1, min(16, block // 1024))


def expect_rows_near(got, want, dtype, what: str) -> None:
    """Two (q, scale) row quantizations of nearly equal inputs in `dtype`: scales within its
    rounding (a row's largest element a last bit apart moves the scale by as much) and
    dequantized values within one e4m3 step here and there (an input a last bit apart can round
    the other way)."""
    (q, s), (q_ref, s_ref) = got, want
    if q.dtype != E4M3 or s.shape != s_ref.shape:
        raise Mismatch(f"disagrees with its torch reference ({what}: {q.dtype}, scales {tuple(s.shape)})")
    expect_near(s, s_ref, dtype, f"{what} scales")
    got_x, want_x = q.float() * s, q_ref.float() * s_ref
    err = ((got_x - want_x).norm() / want_x.norm().clamp_min(1e-12)).item()
    if not err < 2.0**-4:  # e4m3's half step; a wrong index or mask is off by about 1
        raise Mismatch(f"disagrees with its torch reference ({what}: relative error {err:.2e} > 2^-4)")


def check_quantize_rows(fn, device, dtype, kv_dtype=None) -> None:
    for shape in ((37, 200), (5, 8960)):
        x = torch.randn(shape, device=device, dtype=dtype) * 3
        x[0, 1] = 1000.0  # an outlier sets its row's scale
        x[1] = 0.0  # a row of zeros keeps a finite scale
        expect_rows_near(fn(x), quantize_rows(x), dtype, "quantize_rows")


def check_quantize_into(fn, device, dtype, kv_dtype=None) -> None:
    for shape in ((48, 200), (3, 8192 + 40)):  # the second spans two of the kernel's blocks
        noise = torch.randn(shape, device=device, dtype=dtype) * 0.02
        noise.view(-1)[-1] = -0.5  # an outlier in the last block sets the scale
        for x in (noise, torch.zeros_like(noise)):  # all zeros: a finite scale
            q = torch.empty(shape, dtype=E4M3, device=device)
            scale = torch.zeros((), dtype=torch.float32, device=device)
            fn(x, q, scale)
            expect_rows_near((q, scale), quantize(x), dtype, "quantize_into")


def check_scaled_mm(fn, device, dtype, kv_dtype=None) -> None:
    x = torch.randn(37, 256, device=device, dtype=dtype)
    w = torch.randn(48, 256, device=device, dtype=dtype) * 0.05
    bias = torch.randn(48, device=device, dtype=dtype)
    (qx, sx), (qw, sw) = quantize(x), quantize(w)
    expect_near(fn(qx, sx, qw, sw, bias, dtype), scaled_mm_ref(qx, sx, qw, sw, bias, dtype), dtype, "scaled_mm")


class Fp8Weight(nn.Module):
    """An e4m3 copy of `weight` [O, K] and its scale, as buffers (not parameters: checksums and
    loads see only the model-dtype weight); refresh() rewrites both in place."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        object.__setattr__(self, "source", weight)  # the model-dtype weight, not registered here
        self.register_buffer("q", torch.empty(weight.shape, dtype=E4M3, device=weight.device))
        self.register_buffer("scale", torch.ones((), dtype=torch.float32, device=weight.device))
        self.register_buffer("one", torch.ones((), dtype=torch.float32, device=weight.device))

    @torch.no_grad()
    def refresh(self, quantizer=quantize_into) -> None:
        """quantizer: quantize_into or its kernel (the engine's ops.quantize_into)."""
        quantizer(self.source, self.q, self.scale)

    def matmul(self, q_NK: torch.Tensor, ops, dtype) -> torch.Tensor:
        """y' = q · (this weight)ᵀ: the rows of an input quantized by quantize_rows, multiplied
        without their scales (the op that reads y' applies them: rope_store, rmsnorm_rows,
        silu_mul_rows)."""
        return ops.scaled_mm(q_NK, self.one, self.q, self.scale, None, dtype)


def quantizable(weight: torch.Tensor) -> bool:
    """The fp8 GEMM's shape rule: both dimensions multiples of 16."""
    return weight.dim() == 2 and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0
