"""Rotary position embeddings, and rope_store, the op that applies them, in torch and in Triton.

Inverse frequencies come from either config style: transformers >= 5 (`rope_parameters`) or 4.x
(`rope_theta`, `rope_scaling`). rope_store takes a step's fused qkv rows: (Qwen3's per-head q/k
RMSNorm,) rotary on q and k in float32 rounded as transformers rounds, k and v written to their
KV cache slots; one kernel per layer on the GPU. With rollout.quantization = "fp8" the rows are
the qkv fp8 GEMM's output before its rows' scales: the same kernel applies them and the qkv bias
first (fp8_linear.scale_rows), so that GEMM's output needs no kernel of its own.
"""

from __future__ import annotations

import math

import torch

from minirl.errors import UserError
from minirl.kernels.selfcheck import expect_near
from minirl_plugins.engines.native.layers.attention import split_qkv
from minirl_plugins.engines.native.layers.fp8_linear import scale_rows
from minirl_plugins.engines.native.layers.jit import jit, tl
from minirl_plugins.engines.native.layers.meta import Heads
from minirl_plugins.engines.native.layers.norm import rmsnorm


def rope_parameters(config) -> dict:
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None)
    if scaling and not params:
        params = dict(scaling)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def inv_frequencies(params: dict, head_dim: int) -> torch.Tensor:
    """inv_freq_F (F = head_dim / 2), float32, the way transformers computes it."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponent)
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "llama3":
        return _llama3(inv_freq, params)
    raise UserError(
        f"the model's rope_parameters.rope_type = {kind!r} is not supported by rollout.name = 'native' "
        "(it supports default and llama3); use rollout.name = 'hf' for this model"
    )


def _llama3(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, a smooth band between."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def cos_sin_cache(inv_freq: torch.Tensor, max_positions: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_PF, sin_PF in float32 for positions [0, max_positions)."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return freqs.cos().to(device).contiguous(), freqs.sin().to(device).contiguous()


def _rotate(x, cos, sin):
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rope_store(
    qkv, positions, cos, sin, slot_mapping, k_cache, v_cache, heads, q_norm=None, k_norm=None, eps=1e-6, rows=None
):
    """In place on qkv [N, (H + 2Hk)·D]: (q/k norm,) rotary on q and k; k and v written to the cache.
    rows = (row scales [N, 1], the qkv bias or None): qkv is an fp8 GEMM's output before its rows'
    scales, made the GEMM's result first, in place (fp8_linear.scale_rows)."""
    if rows is not None:
        qkv.copy_(scale_rows(qkv, *rows))
    q, k, v = split_qkv(qkv, heads)  # views: rotated in place
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    for x, norm in ((q, q_norm), (k, k_norm)):
        x.copy_(_rotate(x if norm is None else rmsnorm(x, norm, eps), c, s))
    k_cache[slot_mapping] = to_cache(k, k_cache.dtype)
    v_cache[slot_mapping] = to_cache(v, v_cache.dtype)


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in the KV cache's dtype: an 8-bit float cache (rollout.kv_cache_dtype) stores x with
    scale 1, clamped to the format's largest finite value (e4m3 has no infinity)."""
    if x.dtype == dtype:
        return x
    limit = cache_limit(dtype)
    return (x.clamp(-limit, limit) if limit else x).to(dtype)


def cache_limit(dtype: torch.dtype) -> float:
    """The clamp of a KV cache in `dtype`: an 8-bit float's largest finite value, else 0 (none)."""
    return torch.finfo(dtype).max if dtype.is_floating_point and dtype.itemsize == 1 else 0.0


@jit
def _rope_store_kernel(
    qkv_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    k_cache_ptr,
    v_cache_ptr,
    qn_ptr,
    kn_ptr,
    xs_ptr,
    b_ptr,
    stride_tok,
    stride_slot,
    eps,
    H: tl.constexpr,
    HK: tl.constexpr,
    D: tl.constexpr,
    HALF: tl.constexpr,
    QK_NORM: tl.constexpr,
    KV_MAX: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    # KV_MAX > 0: an 8-bit float cache, written with scale 1 and clamped to its largest value;
    # ROW_SCALE: qkv <- qkv · xs[tok] (+ bias) first, rounded to its dtype (fp8_linear.scale_rows)
    tok = tl.program_id(0)
    head = tl.program_id(1)  # q heads, then k heads
    offs = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + tok)
    c = tl.load(cos_ptr + pos * HALF + offs)
    s = tl.load(sin_ptr + pos * HALF + offs)
    base = qkv_ptr + tok * stride_tok + head * D
    x1 = tl.load(base + offs)
    x2 = tl.load(base + HALF + offs)
    dt = x1.dtype
    if ROW_SCALE:
        xs = tl.load(xs_ptr + tok)
        x1 = _scale_row(x1, xs, b_ptr + head * D + offs, HAS_BIAS)
        x2 = _scale_row(x2, xs, b_ptr + head * D + HALF + offs, HAS_BIAS)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if QK_NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
        if head < H:
            w1 = tl.load(qn_ptr + offs).to(tl.float32)
            w2 = tl.load(qn_ptr + HALF + offs).to(tl.float32)
        else:
            w1 = tl.load(kn_ptr + offs).to(tl.float32)
            w2 = tl.load(kn_ptr + HALF + offs).to(tl.float32)
        x1 = ((x1 * rstd).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        x2 = ((x2 * rstd).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
    o1 = (x1 * c - x2 * s).to(dt)
    o2 = (x2 * c + x1 * s).to(dt)
    tl.store(base + offs, o1)
    tl.store(base + HALF + offs, o2)
    if head >= H:
        slot = tl.load(slot_ptr + tok)
        dst = slot * stride_slot + (head - H) * D
        kv_t = k_cache_ptr.dtype.element_ty
        tl.store(k_cache_ptr + dst + offs, _to_cache(o1, kv_t, KV_MAX))
        tl.store(k_cache_ptr + dst + HALF + offs, _to_cache(o2, kv_t, KV_MAX))
        v = base + HK * D
        v1 = tl.load(v + offs)
        v2 = tl.load(v + HALF + offs)
        if ROW_SCALE:  # the attention of a prefill reads v from qkv too
            v1 = _scale_row(v1, xs, b_ptr + (head + HK) * D + offs, HAS_BIAS)
            v2 = _scale_row(v2, xs, b_ptr + (head + HK) * D + HALF + offs, HAS_BIAS)
            tl.store(v + offs, v1)
            tl.store(v + HALF + offs, v2)
        tl.store(v_cache_ptr + dst + offs, _to_cache(v1, kv_t, KV_MAX))
        tl.store(v_cache_ptr + dst + HALF + offs, _to_cache(v2, kv_t, KV_MAX))


@jit
def _scale_row(x, xs, b_ptrs, HAS_BIAS: tl.constexpr):
    """x · xs (+ the bias at b_ptrs) in float32, rounded to x's dtype (fp8_linear.scale_rows)."""
    y = x.to(tl.float32) * xs
    if HAS_BIAS:
        y += tl.load(b_ptrs).to(tl.float32)
    return y.to(x.dtype)


@jit
def _to_cache(x, kv_t: tl.constexpr, KV_MAX: tl.constexpr):
    """to_cache: the cache's dtype, clamped to KV_MAX when that is an 8-bit float's."""
    if KV_MAX > 0:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -KV_MAX), KV_MAX)
    return x.to(kv_t)


def rope_store_triton(
    qkv, positions, cos, sin, slot_mapping, k_cache, v_cache, heads, q_norm=None, k_norm=None, eps=1e-6, rows=None
):
    h, hk, d = heads
    assert d % 2 == 0 and (d // 2) & (d // 2 - 1) == 0, "head_dim/2 must be a power of 2"
    norm = q_norm is not None
    row_scale, bias = rows or (None, None)
    _rope_store_kernel[(qkv.shape[0], h + hk)](
        qkv,
        positions,
        cos,
        sin,
        slot_mapping,
        k_cache,
        v_cache,
        q_norm if norm else qkv,
        k_norm if norm else qkv,
        qkv if row_scale is None else row_scale,  # dummy pointers when absent
        qkv if bias is None else bias,
        qkv.stride(0),
        k_cache.stride(0),
        eps,
        H=h,
        HK=hk,
        D=d,
        HALF=d // 2,
        QK_NORM=norm,
        KV_MAX=cache_limit(k_cache.dtype),
        ROW_SCALE=row_scale is not None,
        HAS_BIAS=bias is not None,
    )


def check_rope_store(fn, device, dtype, kv_dtype=None) -> None:
    """fn against rope_store, with and without q/k norms, and with an fp8 GEMM's row scales
    with and without the qkv bias (the whole of qkv compared: prefill attention reads v from it)."""
    n, h, hk, d, slots = 29, 6, 2, 128, 64
    width = (h + 2 * hk) * d
    xs = torch.rand(n, 1, device=device) * 1e-2
    bias = torch.randn(width, device=device, dtype=dtype)
    for norm, row_scale, b in ((False, None, None), (True, None, None), (False, xs, bias), (True, xs, None)):
        qkv = torch.randn(n, width, device=device, dtype=dtype) * (100 if row_scale is not None else 1)
        pos = torch.randint(0, 100, (n,), device=device)
        ang = torch.rand(100, d // 2, device=device) * 6
        slot = torch.randperm(slots, device=device)[:n]
        qw = kw = None
        if norm:
            qw, kw = (torch.rand(d, device=device, dtype=dtype) + 0.5 for _ in range(2))
        outs = []
        for f in (fn, rope_store):
            buf, kc = qkv.clone(), torch.zeros(slots, hk, d, device=device, dtype=kv_dtype or dtype)
            vc = torch.zeros_like(kc)
            rows = None if row_scale is None else (row_scale, b)
            f(buf, pos, ang.cos(), ang.sin(), slot, kc, vc, Heads(h, hk, d), qw, kw, 1e-6, rows)
            outs.append((buf, kc, vc))
        for got, ref in zip(outs[0], outs[1]):
            expect_near(got, ref, dtype, "rope_store")
