"""Candidate changes to the fp8 pairs decode kernel (paged_attention._decode_kernel_fp8_pairs),
timed against it by `python3 dev/bench_fp8_pairs.py --launches ...` before any goes into the engine.

`next`: flags (constexprs of _next_kernel; all off = the engine's kernel until 2026-12-06, all on =
the engine's kernel since, which the H200 sweep chose):
  SPLIT   the full key blocks in a loop with no masks (loads, scores), the last partial block after
  EXP2    the scale times log2(e) folded into the query once, exp2 in the loop (no multiply per score)
  OFF32   32-bit slot offsets (the caller checks the cache has fewer than 2**31 elements)
`wb`, `wb16`: warp-batched kernels (each warp a running softmax over its share of a key block,
merged at the end), over the fp8 pairs and over a 16-bit cache.
"""

from __future__ import annotations

import torch

from minirl_plugins.engines.native.layers import paged_attention as pa
from minirl_plugins.engines.native.layers.jit import jit, tl


@jit
def _next_kernel(
    q_ptr, k_ptr, v_ptr, pt_ptr, rows_ptr, lens_ptr, o_ptr, lse_ptr, stride_q, stride_slot, stride_pt, stride_o,
    scale, min_chunk,
    H: tl.constexpr, D: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, SPLITS: tl.constexpr, DIRECT: tl.constexpr, PTX: tl.constexpr, E5M2: tl.constexpr,
    SPLIT: tl.constexpr, EXP2: tl.constexpr, OFF32: tl.constexpr,
):  # fmt: skip
    """The pairs kernel with the flags of this module's docstring."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(rows_ptr + b)
    start, end, full_end, splits = pa._chunk(tl.load(lens_ptr + b), split, min_chunk, SPLITS, BLOCK_N)
    if not SPLIT:
        full_end = start
    q_e, q_o = pa._pairs_query(q_ptr, b, stride_q, kvh, scale, G, BLOCK_G, D, EXP2)
    D2: tl.constexpr = D // 2
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc_e = tl.zeros([BLOCK_G, D2], tl.float32)
    acc_o = tl.zeros([BLOCK_G, D2], tl.float32)
    for t0 in range(start, full_end, BLOCK_N):
        m_i, l_i, acc_e, acc_o = pa._pairs_block(
            q_e, q_o, m_i, l_i, acc_e, acc_o, t0, end, row, kvh, k_ptr, v_ptr, pt_ptr, stride_slot, stride_pt,
            scale, D2, BLOCK_N, PAGE, PTX, E5M2, False, EXP2, OFF32,
        )  # fmt: skip
    for t0 in range(full_end, end, BLOCK_N):
        m_i, l_i, acc_e, acc_o = pa._pairs_block(
            q_e, q_o, m_i, l_i, acc_e, acc_o, t0, end, row, kvh, k_ptr, v_ptr, pt_ptr, stride_slot, stride_pt,
            scale, D2, BLOCK_N, PAGE, PTX, E5M2, True, EXP2, OFF32,
        )  # fmt: skip
    inv = 1.0 / tl.maximum(l_i, 1e-30)
    lse = m_i * 0.6931471805599453 + tl.log(l_i) if EXP2 else m_i + tl.log(l_i)
    out_e, out_o = acc_e * inv[:, None], acc_o * inv[:, None]
    pa._store_pairs(
        o_ptr, lse_ptr, b, kvh, split, splits, out_e, out_o, lse, stride_o, H, D, G, BLOCK_G, SPLITS, DIRECT
    )


def decode_attention_next(qkv, k_cache, v_cache, meta, heads, scale, config=None, split=True, exp2=True, off32=True):
    """decode_attention_fp8_pairs through _next_kernel with the given flags."""
    cfg = {**pa.FP8_PAIRS_CONFIG, **(config or {})}
    k2, v2 = k_cache.view(torch.int16), v_cache.view(torch.int16)
    off32 = off32 and k2.numel() < 2**31
    ptx = pa.PAIRS_PTX[k_cache.dtype] if qkv.device.type == "cuda" else None
    consts = dict(PTX=ptx, E5M2=k_cache.dtype == torch.float8_e5m2, SPLIT=split, EXP2=exp2, OFF32=off32)
    return pa._split_k(_next_kernel, qkv, k2, v2, meta, heads, scale, cfg, **consts)


@jit
def _wb_keys(t0, end, row, kvh, pt_ptr, stride_slot, stride_pt, W: tl.constexpr, KB: tl.constexpr,
             DK: tl.constexpr, PAGE: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """The [W, KB, DK] offsets of keys t0 + w KB + j in a cache of DK elements a KV head, and
    which of them are before `end`."""
    w = tl.arange(0, W)
    j = tl.arange(0, KB)
    e = tl.arange(0, DK)
    tok = t0 + w[:, None] * KB + j[None, :]
    valid = tok < end
    if MASKED:
        page = tl.load(pt_ptr + row * stride_pt + tok // PAGE, mask=valid, other=0)
    else:
        page = tl.load(pt_ptr + row * stride_pt + tok // PAGE)
    slot = page * PAGE + tok % PAGE
    return slot[:, :, None] * stride_slot + kvh * DK + e[None, None, :], valid


@jit
def _wb_load(ptr, kv_off, valid, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptr + kv_off, mask=valid[:, :, None], other=0)
    return tl.load(ptr + kv_off)


@jit
def _wb_softmax(s, m_i, l_i, valid, MASKED: tl.constexpr):
    """The online-softmax step of [W, G, KB] scores in log2 units: (max, sum, rescale, probabilities)."""
    if MASKED:
        s = tl.where(valid[:, None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=2))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, :, None])
    if MASKED:  # a warp whose keys are all masked so far (a full block leaves every max finite)
        alpha = tl.where(m_new == float("-inf"), 1.0, alpha)
        p = tl.where(m_new[:, :, None] == float("-inf"), 0.0, p)
    return m_new, l_i * alpha + tl.sum(p, axis=2), alpha, p


@jit
def _wb_weights(m_i, l_i):
    """Merging the W warps' softmaxes: (the max in log2 units, each warp's weight, the sum)."""
    m = tl.max(m_i, axis=0)
    wgt = tl.exp2(m_i - tl.where(m == float("-inf"), 0.0, m)[None, :])  # 0 for a part with no keys
    return m, wgt, tl.sum(l_i * wgt, axis=0)


@jit
def _wb_block(
    q_e, q_o, m_i, l_i, acc_e, acc_o, t0, end, row, kvh, k_ptr, v_ptr, pt_ptr, stride_slot, stride_pt,
    W: tl.constexpr, KB: tl.constexpr, D2: tl.constexpr, PAGE: tl.constexpr, PTX: tl.constexpr,
    E5M2: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """W independent online softmaxes over KB keys each (one per warp: batched dots, no exchange
    between warps), keys t0 + w KB + j."""
    kv_off, valid = _wb_keys(t0, end, row, kvh, pt_ptr, stride_slot, stride_pt, W, KB, D2, PAGE, MASKED)
    k_e, k_o = pa._pairs_to_f16(_wb_load(k_ptr, kv_off, valid, MASKED), PTX, E5M2)
    s = tl.dot(q_e, tl.permute(k_e, (0, 2, 1))) + tl.dot(q_o, tl.permute(k_o, (0, 2, 1)))
    m_new, l_i, alpha, p = _wb_softmax(s, m_i, l_i, valid, MASKED)
    v_e, v_o = pa._pairs_to_f16(_wb_load(v_ptr, kv_off, valid, MASKED), PTX, E5M2)
    p16 = p.to(tl.float16)
    acc_e = acc_e * alpha[:, :, None] + tl.dot(p16, v_e)
    acc_o = acc_o * alpha[:, :, None] + tl.dot(p16, v_o)
    return m_new, l_i, acc_e, acc_o


@jit
def _wb_kernel(
    q_ptr, k_ptr, v_ptr, pt_ptr, rows_ptr, lens_ptr, o_ptr, lse_ptr, stride_q, stride_slot, stride_pt, stride_o,
    scale, min_chunk,
    H: tl.constexpr, D: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, SPLITS: tl.constexpr, DIRECT: tl.constexpr, PTX: tl.constexpr, E5M2: tl.constexpr,
    W: tl.constexpr,
):  # fmt: skip
    """The pairs kernel with a block of BLOCK_N keys cut into W warp-sized parts of BLOCK_N / W
    keys, each with its own running max, sum and output (batched dots), merged once at the end;
    the SPLIT, EXP2 and OFF32 changes of _next_kernel included."""
    KB: tl.constexpr = BLOCK_N // W
    D2: tl.constexpr = D // 2
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(rows_ptr + b)
    start, end, full_end, splits = pa._chunk(tl.load(lens_ptr + b), split, min_chunk, SPLITS, BLOCK_N)
    q_e, q_o = pa._pairs_query(q_ptr, b, stride_q, kvh, scale, G, BLOCK_G, D, True)
    q_e3 = tl.broadcast_to(q_e[None, :, :], [W, BLOCK_G, D2])
    q_o3 = tl.broadcast_to(q_o[None, :, :], [W, BLOCK_G, D2])
    m_i = tl.full([W, BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([W, BLOCK_G], tl.float32)
    acc_e = tl.zeros([W, BLOCK_G, D2], tl.float32)
    acc_o = tl.zeros([W, BLOCK_G, D2], tl.float32)
    for t0 in range(start, full_end, BLOCK_N):
        m_i, l_i, acc_e, acc_o = _wb_block(
            q_e3, q_o3, m_i, l_i, acc_e, acc_o, t0, end, row, kvh, k_ptr, v_ptr, pt_ptr, stride_slot, stride_pt,
            W, KB, D2, PAGE, PTX, E5M2, False,
        )  # fmt: skip
    for t0 in range(full_end, end, BLOCK_N):
        m_i, l_i, acc_e, acc_o = _wb_block(
            q_e3, q_o3, m_i, l_i, acc_e, acc_o, t0, end, row, kvh, k_ptr, v_ptr, pt_ptr, stride_slot, stride_pt,
            W, KB, D2, PAGE, PTX, E5M2, True,
        )  # fmt: skip
    m, wgt, l_sum = _wb_weights(m_i, l_i)
    inv = 1.0 / tl.maximum(l_sum, 1e-30)
    out_e = tl.sum(acc_e * wgt[:, :, None], axis=0) * inv[:, None]
    out_o = tl.sum(acc_o * wgt[:, :, None], axis=0) * inv[:, None]
    lse = m * 0.6931471805599453 + tl.log(l_sum)
    pa._store_pairs(
        o_ptr, lse_ptr, b, kvh, split, splits, out_e, out_o, lse, stride_o, H, D, G, BLOCK_G, SPLITS, DIRECT
    )


def decode_attention_wb(qkv, k_cache, v_cache, meta, heads, scale, config=None):
    """decode_attention_fp8_pairs through _wb_kernel (32-bit slot offsets: the cache must have
    fewer than 2**31 int16 elements)."""
    cfg = {**pa.FP8_PAIRS_CONFIG, **(config or {})}
    k2, v2 = k_cache.view(torch.int16), v_cache.view(torch.int16)
    assert k2.numel() < 2**31
    ptx = pa.PAIRS_PTX[k_cache.dtype] if qkv.device.type == "cuda" else None
    consts = dict(PTX=ptx, E5M2=k_cache.dtype == torch.float8_e5m2, W=cfg["num_warps"])
    return pa._split_k(_wb_kernel, qkv, k2, v2, meta, heads, scale, cfg, **consts)


@jit
def _wb16_block(
    q, m_i, l_i, acc, t0, end, row, kvh, k_ptr, v_ptr, pt_ptr, stride_slot, stride_pt,
    W: tl.constexpr, KB: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """_wb_block over a 16-bit cache: W running softmaxes over KB keys each."""
    kv_off, valid = _wb_keys(t0, end, row, kvh, pt_ptr, stride_slot, stride_pt, W, KB, D, PAGE, MASKED)
    s = tl.dot(q, tl.permute(_wb_load(k_ptr, kv_off, valid, MASKED), (0, 2, 1)))
    m_new, l_i, alpha, p = _wb_softmax(s, m_i, l_i, valid, MASKED)
    v = _wb_load(v_ptr, kv_off, valid, MASKED)
    return m_new, l_i, acc * alpha[:, :, None] + tl.dot(p.to(v.dtype), v)


@jit
def _wb16_kernel(
    q_ptr, k_ptr, v_ptr, pt_ptr, rows_ptr, lens_ptr, o_ptr, lse_ptr, stride_q, stride_slot, stride_pt, stride_o,
    scale, min_chunk,
    H: tl.constexpr, D: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, SPLITS: tl.constexpr, DIRECT: tl.constexpr, W: tl.constexpr,
):  # fmt: skip
    """_wb_kernel over a 16-bit cache (the default kernel's, bf16 or float16 like the query)."""
    KB: tl.constexpr = BLOCK_N // W
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(rows_ptr + b)
    length = tl.load(lens_ptr + b)
    start, end, full_end, splits = pa._chunk(length, split, min_chunk, SPLITS, BLOCK_N)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    heads = kvh * G + g
    hm = g[:, None] < G
    q = tl.load(q_ptr + b * stride_q + heads[:, None] * D + d[None, :], mask=hm, other=0.0)
    q = (q.to(tl.float32) * (scale * 1.4426950408889634)).to(k_ptr.dtype.element_ty)
    q3 = tl.broadcast_to(q[None, :, :], [W, BLOCK_G, D])
    m_i = tl.full([W, BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([W, BLOCK_G], tl.float32)
    acc = tl.zeros([W, BLOCK_G, D], tl.float32)
    for t0 in range(start, full_end, BLOCK_N):
        m_i, l_i, acc = _wb16_block(
            q3, m_i, l_i, acc, t0, end, row, kvh, k_ptr, v_ptr, pt_ptr, stride_slot, stride_pt, W, KB, D, PAGE, False
        )
    for t0 in range(full_end, end, BLOCK_N):
        m_i, l_i, acc = _wb16_block(
            q3, m_i, l_i, acc, t0, end, row, kvh, k_ptr, v_ptr, pt_ptr, stride_slot, stride_pt, W, KB, D, PAGE, True
        )
    m, wgt, l_sum = _wb_weights(m_i, l_i)
    out = tl.sum(acc * wgt[:, :, None], axis=0) / tl.maximum(l_sum, 1e-30)[:, None]
    hmask = hm & (split < splits)
    if DIRECT:
        tl.store(o_ptr + b * stride_o + heads[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty), mask=hmask)
    else:
        part = (b * H + heads) * SPLITS + split
        tl.store(o_ptr + part[:, None] * D + d[None, :], out, mask=hmask)
        tl.store(lse_ptr + part, m * 0.6931471805599453 + tl.log(l_sum), mask=(g < G) & (split < splits))


def decode_attention_wb16(qkv, k_cache, v_cache, meta, heads, scale, config=None):
    """decode_attention over a 16-bit cache through _wb16_kernel (32-bit slot offsets)."""
    programs = qkv.shape[0] * heads.num_kv_heads * meta.num_splits
    cfg = {**pa.DECODE_CONFIG, "block_n": pa.decode_block_n(programs, qkv.device), **(config or {})}
    assert k_cache.numel() < 2**31 and k_cache.dtype == qkv.dtype
    return pa._split_k(_wb16_kernel, qkv, k_cache, v_cache, meta, heads, scale, cfg, W=cfg["num_warps"])
