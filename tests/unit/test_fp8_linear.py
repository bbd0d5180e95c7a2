"""rollout.quantization = "fp8": the quantizers (per tensor for weights, per row for activations)
round within e4m3's bounds, the GEMM reference is the float64 product of the dequantized values,
and a quantized linear (rows quantized, GEMM without their scales, scales and bias applied after)
stays within the error bound those give, against the float64 product of the unrounded inputs.

The Triton kernels against these references: tests/unit/test_native_triton.py (under the
interpreter) and tests/unit/test_native_gpu.py (compiled); the engine: tests/unit/test_native_engine.py.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minirl_plugins.engines.native.layers import fp8_linear as f

NORMAL = 2.0**-6  # e4m3's smallest normal value
HALF_ULP = 2.0**-4  # relative, over normal values (3 mantissa bits)
SUB_HALF_ULP = 2.0**-10  # absolute, below NORMAL (the subnormal step is 2^-9)


def tensors(draw, rows, cols):
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(rows, cols, generator=gen, dtype=torch.float64) * 10.0 ** draw(st.integers(-6, 4))
    if draw(st.booleans()):  # an outlier: most values fall far below the scale, some subnormal
        x[draw(st.integers(0, rows - 1)), draw(st.integers(0, cols - 1))] *= 1e4
    return x


@st.composite
def matrices(draw):
    return tensors(draw, draw(st.integers(1, 9)), draw(st.integers(1, 40)))


@settings(max_examples=60, deadline=None)
@given(matrices(), st.sampled_from([torch.float32, torch.bfloat16]))
def test_quantize_rounds_each_element_within_e4m3s_half_step(x, dtype):
    x = x.to(dtype)
    q, scale = f.quantize(x)
    xd = x.double()
    amax = xd.abs().max()
    assert q.dtype == f.E4M3 and scale.dtype == torch.float32 and scale.dim() == 0
    assert float(scale) == pytest.approx(float(amax) / 448.0, rel=1e-6)
    err = (q.double() * float(scale) - xd).abs()
    bound = torch.where(xd.abs() >= NORMAL * float(scale), HALF_ULP * xd.abs(), SUB_HALF_ULP * float(scale))
    assert (err <= bound * (1 + 1e-6) + 1e-30).all()
    assert q.float().abs().max() == 448.0  # the largest element lands on e4m3's largest value


def test_quantize_of_zeros_is_zeros_with_a_finite_scale():
    q, scale = f.quantize(torch.zeros(3, 16))
    assert torch.isfinite(scale) and float(scale) > 0 and (q.float() == 0).all()


@settings(max_examples=60, deadline=None)
@given(matrices(), st.sampled_from([torch.float32, torch.bfloat16]))
def test_quantize_rows_rounds_each_row_on_its_own_scale(x, dtype):
    """Per row, the same bounds as the tensor's quantizer with the row's own amax: a row far below
    another keeps its precision (no batch-mate's outlier sets its scale)."""
    x = x.to(dtype)
    q, scale = f.quantize_rows(x)
    assert scale.shape == (x.shape[0], 1) and scale.dtype == torch.float32
    for i in range(x.shape[0]):
        q_i, s_i = f.quantize(x[i : i + 1])
        assert torch.equal(q[i : i + 1].view(torch.uint8), q_i.view(torch.uint8)) and torch.equal(scale[i, 0], s_i)


@st.composite
def gemm_inputs(draw):
    n, k, o = draw(st.integers(1, 6)), draw(st.integers(1, 48)), draw(st.integers(1, 8))
    return tensors(draw, n, k), tensors(draw, o, k), draw(st.booleans())


@settings(max_examples=60, deadline=None)
@given(gemm_inputs())
def test_the_quantized_linear_is_within_the_bound_the_two_roundings_give(inputs):
    """y = x Wᵀ (+ b) as the fp8 decoder computes it (x quantized by rows, the GEMM over the e4m3
    copy without the rows' scales, then scale_rows with the bias), against float64: with
    x = x̂ + e_x and W = Ŵ + e_W, the error is Σ_k |e_x||W| + |x̂||e_W| per output, each |e| at
    most the half step of the tests above, plus float32's rounding of the sums and the output."""
    x64, w64, with_bias = inputs
    x, w = x64.float(), w64.float()
    bias = torch.randn(w.shape[0]) if with_bias else None
    fp8 = f.Fp8Weight(w)
    fp8.refresh()
    ops = type("Ops", (), {"scaled_mm": staticmethod(f.scaled_mm_ref)})
    q, scale = f.quantize_rows(x)
    y = f.scale_rows(fp8.matmul(q, ops, torch.float32), scale, bias).double()
    want = x64 @ w64.t() + (0 if bias is None else bias.double())
    sx, sw = x64.abs().amax(1, keepdim=True) / 448, float(w64.abs().max()) / 448
    ex = HALF_ULP * x64.abs() + SUB_HALF_ULP * sx
    ew = HALF_ULP * w64.abs() + SUB_HALF_ULP * sw
    bound = ex @ w64.abs().t() + (x64.abs() + ex) @ ew.t()
    magnitude = (x64.abs() + ex) @ (w64.abs() + ew).t() + (0 if bias is None else bias.double().abs())
    slack = magnitude * 2.0**-24 * (x.shape[1] + 4)
    assert ((y - want).abs() <= bound + slack + 1e-30).all()


def test_scaled_mm_reference_is_the_float64_product_of_the_dequantized_values():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 64, generator=gen), torch.randn(24, 64, generator=gen)
    bias = torch.randn(24, generator=gen)
    (qx, sx), (qw, sw) = f.quantize(x), f.quantize(w)
    got = f.scaled_mm_ref(qx, sx, qw, sw, bias, torch.float32)
    want = (qx.double() * float(sx)) @ (qw.double() * float(sw)).t() + bias.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def test_a_refresh_rewrites_the_copy_in_place():
    """The forward of a captured CUDA graph reads the copy's storage: a refresh after a load keeps
    it and its scale's, and the copy follows the weight."""
    w = torch.randn(32, 16)
    fp8 = f.Fp8Weight(w)
    fp8.refresh()
    ptrs = (fp8.q.data_ptr(), fp8.scale.data_ptr())
    w.mul_(3.0)
    fp8.refresh()
    assert (fp8.q.data_ptr(), fp8.scale.data_ptr()) == ptrs
    q, scale = f.quantize(w)
    assert torch.equal(fp8.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(fp8.scale, scale)
    assert [name for name, _ in fp8.named_parameters()] == []  # loads and checksums see the weight only


def test_scale_rows_applies_each_rows_scale_then_the_bias():
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(3, 5, generator=gen).to(torch.bfloat16)
    s, b = torch.tensor([[2.0], [0.5], [1e-3]]), torch.randn(5, generator=gen).to(torch.bfloat16)
    want = (y.double() * s.double() + b.double()).to(torch.bfloat16)
    assert torch.equal(f.scale_rows(y, s, b), want) and torch.equal(f.scale_rows(y, s), (y.double() * s).to(y.dtype))


@pytest.mark.parametrize("shape, ok", [((32, 16), True), ((24, 40), False), ((30, 16), False), ((16,), False)])
def test_quantizable_asks_both_dimensions_in_multiples_of_16(shape, ok):
    assert f.quantizable(torch.empty(shape)) == ok
