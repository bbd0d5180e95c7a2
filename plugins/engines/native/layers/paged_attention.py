"""Decode attention over the paged KV cache: the torch reference and its split-K Triton kernels.

Each decode row's one query attends to its cached keys, found through its page-table row. The
reference gathers those pages into a dense [B, Hk, T, D] tensor for SDPA under a length mask. The
kernel reads the pages in place, several programs per row and KV head (each a chunk of the
context, online softmax over blocks of keys) merged by a second kernel by their log-sum-exps, so
short batches still fill the GPU. An 8-bit float cache is upcast as it is read.

Shape legend: B decode rows, H query heads, Hk KV heads, D head dim, T context tokens.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from minirl.kernels.selfcheck import Mismatch, expect_near
from minirl_plugins.engines.native.layers.jit import jit, tl, triton
from minirl_plugins.engines.native.layers.meta import Heads, StepMeta


def decode_attention(qkv, k_cache, v_cache, meta: StepMeta, heads: Heads, scale: float):
    """One query per row over its cached keys: gather the rows' pages, mask, SDPA."""
    h, hk, d = heads
    q = qkv[:, : h * d].view(-1, h, 1, d)
    max_ctx = meta.max_ctx or int(meta.ctx_lens_B.max())
    pos_T = torch.arange(max_ctx, device=qkv.device)
    pages_BT = meta.page_table[meta.rows_B][:, pos_T // meta.page_size].long()
    slots_BT = pages_BT * meta.page_size + pos_T % meta.page_size
    k = k_cache[slots_BT].to(q.dtype).transpose(1, 2)  # B Hk T D
    v = v_cache[slots_BT].to(q.dtype).transpose(1, 2)
    mask = (pos_T[None, :] < meta.ctx_lens_B[:, None])[:, None, None, :]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=h != hk)
    return o.reshape(-1, h * d)


# Launch settings, from a sweep on an H200 (scripts/bench_rollout.py --sweep-attention). A row
# uses fewer splits than the step's when its context is short (min_chunk tokens per split at
# least): each split costs a partial write and a merge. fp8_f16: an fp8 cache's keys and values
# are upcast to float16 (one native conversion on Hopper) and the dots run in float16.
DECODE_CONFIG = {
    "block_n": 128,
    "num_warps": 4,
    "num_stages": 2,
    "min_chunk": 256,
    "fp8_f16": False,
}
# An fp8 cache: float16 dots over 32-key blocks in three stages, the fastest at both swept shapes
# (40.5 us against the bf16 settings' 62.0 at batch 256 x context 600; docs/benchmarks-history.md).
FP8_DECODE_CONFIG = {"block_n": 32, "num_stages": 3, "fp8_f16": True}


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The CUDA device's multiprocessor count, read once: every decode step's launch depends on it."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_splits(rows: int, kv_heads: int, device: torch.device) -> int:
    """Programs per row and KV head (split-K, at most 16), fixed per CUDA-graph bucket: one once
    rows x KV heads fill the multiprocessors (the fastest in the sweep), more for small batches."""
    if device.type != "cuda":
        return 1
    programs, sms = rows * kv_heads, multiprocessors(device)
    if programs >= sms:
        return 1
    return min(16, 1 << ((2 * sms + programs - 1) // programs - 1).bit_length())


def decode_block_n(programs: int, device: torch.device) -> int:
    """Keys per block of decode attention, from the H200 sweep (docs/benchmarks-history.md): 64
    when the programs (rows x KV heads x splits) make 3 to 6 times the multiprocessor count (13%
    faster at batch 256 and 2 KV heads), 128 below and above."""
    if device.type != "cuda":
        return DECODE_CONFIG["block_n"]
    sms = multiprocessors(device)
    return 64 if 3 * sms <= programs < 6 * sms else DECODE_CONFIG["block_n"]


@jit
def _chunk(length, split, min_chunk, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's keys [start, end) of a row of `length`, the end of its full blocks, and the
    row's split count (split-K: at most SPLITS chunks of at least min_chunk keys, whole blocks)."""
    splits = tl.minimum(tl.maximum(tl.cdiv(length, min_chunk), 1), SPLITS)
    chunk = tl.cdiv(tl.cdiv(length, splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.where(split < splits, tl.minimum(length, start + chunk), start)
    return start, end, start + (end - start) // BLOCK_N * BLOCK_N, splits


@jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pt_ptr,
    rows_ptr,
    lens_ptr,
    o_ptr,
    lse_ptr,
    stride_q,
    stride_slot,
    stride_pt,
    stride_o,
    scale,
    min_chunk,
    H: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    SPLITS: tl.constexpr,
    DIRECT: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_F16: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(rows_ptr + b)
    start, end, _, splits = _chunk(tl.load(lens_ptr + b), split, min_chunk, SPLITS, BLOCK_N)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    n = tl.arange(0, BLOCK_N)
    heads = kvh * G + g
    q = tl.load(q_ptr + b * stride_q + heads[:, None] * D + d[None, :], mask=g[:, None] < G, other=0.0)
    if KV_F16:  # an fp8 cache read through float16 (clamped to its range), not bfloat16
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        tok = t0 + n
        valid = tok < end
        page = tl.load(pt_ptr + row * stride_pt + tok // PAGE, mask=valid, other=0)
        slot = page.to(tl.int64) * PAGE + tok % PAGE
        kv_off = slot[:, None] * stride_slot + kvh * D + d[None, :]
        k = tl.load(k_ptr + kv_off, mask=valid[:, None], other=0.0).to(q.dtype)  # an fp8 cache: upcast
        v = tl.load(v_ptr + kv_off, mask=valid[:, None], other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
        m_i = m_new
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    hmask = (g[:, None] < G) & (split < splits)
    if DIRECT:
        tl.store(o_ptr + b * stride_o + heads[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty), mask=hmask)
    else:
        part = (b * H + heads) * SPLITS + split
        tl.store(o_ptr + part[:, None] * D + d[None, :], out, mask=hmask)
        lse = m_i + tl.log(l_i)
        tl.store(lse_ptr + part, lse, mask=(g < G) & (split < splits))


@jit
def _merge_kernel(
    part_ptr, lse_ptr, lens_ptr, o_ptr, stride_o, min_chunk, H: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    length = tl.load(lens_ptr + b)
    splits = tl.minimum(tl.maximum(tl.cdiv(length, min_chunk), 1), SPLITS)
    sp = tl.arange(0, SPLITS)
    used = sp < splits
    d = tl.arange(0, D)
    base = (b * H + h) * SPLITS
    lse = tl.load(lse_ptr + base + sp, mask=used, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, axis=0))
    w = w / tl.sum(w, axis=0)
    parts = tl.load(part_ptr + (base + sp)[:, None] * D + d[None, :], mask=used[:, None], other=0.0)
    out = tl.sum(parts * w[:, None], axis=0)
    tl.store(o_ptr + b * stride_o + h * D + d, out.to(o_ptr.dtype.element_ty))


def decode_attention_triton(qkv, k_cache, v_cache, meta: StepMeta, heads: Heads, scale: float, config=None):
    """decode_attention in split-K Triton kernels; `config` overrides launch settings (the sweep)."""
    fp8 = k_cache.dtype.itemsize == 1
    programs = qkv.shape[0] * heads.num_kv_heads * meta.num_splits
    launch = FP8_DECODE_CONFIG if fp8 else {"block_n": decode_block_n(programs, qkv.device)}
    cfg = {**DECODE_CONFIG, **launch, **(config or {})}
    precision = "ieee" if qkv.dtype == torch.float32 else "tf32"
    kv_f16 = fp8 and bool(cfg["fp8_f16"]) and qkv.dtype == torch.bfloat16
    return _split_k(_decode_kernel, qkv, k_cache, v_cache, meta, heads, scale, cfg, PRECISION=precision, KV_F16=kv_f16)


def _split_k(
    kernel, qkv, k_cache, v_cache, meta: StepMeta, heads: Heads, scale: float, cfg: dict, merge=None, **consts
):
    """The output [B, H·D] of a split-K decode kernel (_decode_kernel's arguments, the caches as
    the kernel reads them, its own constexprs in `consts`), launched with cfg's block_n, min_chunk,
    num_warps, num_stages and maxnreg (a register cap, where given): meta.num_splits programs per
    row and KV head; with one split it writes the output directly, with more its partial outputs
    and log-sum-exps, which _merge_kernel combines, or, for a kernel that takes `merge` (its
    MERGE, count_ptr and out_ptr: "last" or "kernel"), where merge is "last" and meta has
    split_counts, the last program of each row (_merge_if_last)."""
    (h, hk, d), b, splits = heads, qkv.shape[0], meta.num_splits
    out = torch.empty(b, h * d, dtype=qkv.dtype, device=qkv.device)
    if splits == 1:
        part, lse = out, out
    else:
        part = torch.empty(b * h * splits, d, dtype=torch.float32, device=qkv.device)
        lse = torch.empty(b * h * splits, dtype=torch.float32, device=qkv.device)
    last = merge == "last" and splits > 1 and meta.split_counts is not None
    if merge is not None:
        consts.update(
            MERGE=last, count_ptr=meta.split_counts if last else lse, out_ptr=out, BLOCK_H=triton.next_power_of_2(h)
        )
    kernel[(b, hk, splits)](
        qkv,
        k_cache,
        v_cache,
        meta.page_table,
        meta.rows_B,
        meta.ctx_lens_B,
        part,
        lse,
        qkv.stride(0),
        k_cache.stride(0),
        meta.page_table.stride(0),
        out.stride(0),
        scale,
        cfg["min_chunk"],
        H=h,
        D=d,
        G=h // hk,
        BLOCK_G=max(16, triton.next_power_of_2(h // hk)),
        BLOCK_N=cfg["block_n"],
        PAGE=meta.page_size,
        SPLITS=splits,
        DIRECT=splits == 1,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
        **consts,
    )
    if splits > 1 and not last:
        _merge_kernel[(b, h)](part, lse, meta.ctx_lens_B, out, out.stride(0), cfg["min_chunk"], H=h, D=d, SPLITS=splits)
    return out


# An 8-bit cache read as 16-bit pairs (decode_attention_fp8_pairs): the fastest launch at 64 x 27,700,
# 64 x 14,000 and 256 x 600 on an H200 (dev/bench_fp8_pairs.py; two warps: 3.64 TB/s at 27,700 keys
# where four read 3.53)
# merge "last": the last of a row's programs merges its splits, in the kernel (_merge_if_last;
# StepMeta.split_counts holds the counts), one launch fewer a layer: 2.1-2.2 us less at 64 rows x
# 14,000 and 27,700 keys on an H100 (dev/bench_fp8_pairs.py, pairs-l against pairs-k), the same at
# 256 rows (one split, nothing to merge); "kernel": _merge_kernel does, after the kernel
FP8_PAIRS_CONFIG = {"block_n": 64, "num_warps": 2, "num_stages": 2, "min_chunk": 256, "merge": "last"}
OFF32_LIMIT = 2**31 - 1  # the largest element offset the pairs kernel computes in 32 bits


# Per two int16 elements (four fp8 values): a byte permute gathers their low bytes and their high
# bytes, and a native conversion (sm_89+) widens each pair to f16x2
_PAIRS_PTX = """{{
.reg .b32 t;
.reg .b16 lo, hi;
prmt.b32 t, $2, 0, 0x3120;
mov.b32 {{lo, hi}}, t;
cvt.rn.f16x2.{fmt}x2 $0, lo;
cvt.rn.f16x2.{fmt}x2 $1, hi;
}}"""
PAIRS_PTX = {torch.float8_e4m3fn: _PAIRS_PTX.format(fmt="e4m3"), torch.float8_e5m2: _PAIRS_PTX.format(fmt="e5m2")}


@jit
def _pairs_to_f16(x, PTX: tl.constexpr, E5M2: tl.constexpr):
    """int16 pairs of fp8 values -> (the low bytes, the high bytes) in float16: by PTX (PAIRS_PTX)
    when given, else (None) by Triton's own byte operations (the interpreter runs no inline PTX)."""
    if PTX is not None:
        return tl.inline_asm_elementwise(
            asm=PTX, constraints="=r,=r,r", args=[x], dtype=(tl.float16, tl.float16), is_pure=True, pack=2
        )
    fp8 = tl.float8e5 if E5M2 else tl.float8e4nv
    lo = (x & 0xFF).to(tl.uint8).to(fp8, bitcast=True).to(tl.float16)
    hi = ((x >> 8) & 0xFF).to(tl.uint8).to(fp8, bitcast=True).to(tl.float16)
    return lo, hi


@jit
def _pairs_query(q_ptr, b, stride_q, kvh, scale, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                 EXP2: tl.constexpr):  # fmt: skip
    """The KV head's query heads in float16, even and odd dims apart; with EXP2 times scale·log2(e),
    so that the scores come out in log2 units (exp2(s) = exp(s / log2(e))) and need no scaling."""
    g = tl.arange(0, BLOCK_G)
    e = tl.arange(0, D // 2)
    q_at = q_ptr + b * stride_q + (kvh * G + g)[:, None] * D + 2 * e[None, :]
    q_e = tl.load(q_at, mask=g[:, None] < G, other=0.0).to(tl.float32)
    q_o = tl.load(q_at + 1, mask=g[:, None] < G, other=0.0).to(tl.float32)
    if EXP2:
        q_e, q_o = q_e * (scale * 1.4426950408889634), q_o * (scale * 1.4426950408889634)
    q_e = tl.minimum(tl.maximum(q_e, -65504.0), 65504.0).to(tl.float16)
    q_o = tl.minimum(tl.maximum(q_o, -65504.0), 65504.0).to(tl.float16)
    return q_e, q_o


@jit
def _pairs_block(
    q_e, q_o, m_i, l_i, acc_e, acc_o, t0, end, row, kvh, k_ptr, v_ptr, pt_ptr, stride_slot, stride_pt, scale,
    D2: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, PTX: tl.constexpr, E5M2: tl.constexpr,
    MASKED: tl.constexpr, EXP2: tl.constexpr, OFF32: tl.constexpr,
):  # fmt: skip
    """The online-softmax update of (m_i, l_i, acc_e, acc_o) by the BLOCK_N keys from t0: masked
    against `end` only where MASKED (the last, partial block); scores in log2 units with EXP2;
    32-bit slot offsets with OFF32."""
    n = tl.arange(0, BLOCK_N)
    e = tl.arange(0, D2)
    tok = t0 + n
    valid = tok < end
    if MASKED:
        page = tl.load(pt_ptr + row * stride_pt + tok // PAGE, mask=valid, other=0)
    else:
        page = tl.load(pt_ptr + row * stride_pt + tok // PAGE)
    if OFF32:
        slot = page * PAGE + tok % PAGE
    else:
        slot = page.to(tl.int64) * PAGE + tok % PAGE
    kv_off = slot[:, None] * stride_slot + kvh * D2 + e[None, :]
    if MASKED:
        k2 = tl.load(k_ptr + kv_off, mask=valid[:, None], other=0)
    else:
        k2 = tl.load(k_ptr + kv_off)
    k_e, k_o = _pairs_to_f16(k2, PTX, E5M2)
    s = tl.dot(q_e, tl.trans(k_e)) + tl.dot(q_o, tl.trans(k_o))
    if not EXP2:
        s = s * scale
    if MASKED:
        s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if EXP2:
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
    else:
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if MASKED:
        v2 = tl.load(v_ptr + kv_off, mask=valid[:, None], other=0)
    else:
        v2 = tl.load(v_ptr + kv_off)
    v_e, v_o = _pairs_to_f16(v2, PTX, E5M2)
    p16 = p.to(tl.float16)
    acc_e = acc_e * alpha[:, None] + tl.dot(p16, v_e)
    acc_o = acc_o * alpha[:, None] + tl.dot(p16, v_o)
    return m_new, l_i, acc_e, acc_o


@jit
def _store_pairs(o_ptr, lse_ptr, b, kvh, split, splits, out_e, out_o, lse, stride_o, H: tl.constexpr,
                 D: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, SPLITS: tl.constexpr,
                 DIRECT: tl.constexpr):  # fmt: skip
    """The normalised output's even and odd dims: into the output (one split) or this split's
    partial row, with its log-sum-exp (natural log)."""
    g = tl.arange(0, BLOCK_G)
    e = tl.arange(0, D // 2)
    heads = kvh * G + g
    hmask = (g[:, None] < G) & (split < splits)
    if DIRECT:
        at = o_ptr + b * stride_o + heads[:, None] * D + 2 * e[None, :]
        tl.store(at, out_e.to(o_ptr.dtype.element_ty), mask=hmask)
        tl.store(at + 1, out_o.to(o_ptr.dtype.element_ty), mask=hmask)
    else:
        part = (b * H + heads) * SPLITS + split
        at = o_ptr + part[:, None] * D + 2 * e[None, :]
        tl.store(at, out_e, mask=hmask)
        tl.store(at + 1, out_o, mask=hmask)
        tl.store(lse_ptr + part, lse, mask=(g < G) & (split < splits))


@jit
def _decode_kernel_fp8_pairs(
    q_ptr, k_ptr, v_ptr, pt_ptr, rows_ptr, lens_ptr, o_ptr, lse_ptr, stride_q, stride_slot, stride_pt, stride_o,
    scale, min_chunk, count_ptr, out_ptr,
    H: tl.constexpr, D: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, SPLITS: tl.constexpr, DIRECT: tl.constexpr, PTX: tl.constexpr, E5M2: tl.constexpr,
    OFF32: tl.constexpr, MERGE: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """_decode_kernel over an 8-bit cache viewed as int16 [slots, Hk, D/2]: each element holds the
    values of head dims 2j and 2j+1. The tiles then move as a bf16 cache's do (16-byte
    asynchronous copies, ldmatrix), and each is split in registers into the even and the odd
    dims in float16, already in the matrix instruction's operand layout. The dots run over half
    the head dim twice: scores = q_even k_even^T + q_odd k_odd^T, out_even = P v_even, out_odd =
    P v_odd. The full blocks of keys run with no masks and the partial last one after them; the
    scores are in log2 units (scale·log2(e) folded into the query: exp2, no multiply a score);
    OFF32: 32-bit slot offsets (the caller checks the cache's size); MERGE: the row's last program
    merges its splits into out_ptr (_merge_if_last)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(rows_ptr + b)
    start, end, full_end, splits = _chunk(tl.load(lens_ptr + b), split, min_chunk, SPLITS, BLOCK_N)
    q_e, q_o = _pairs_query(q_ptr, b, stride_q, kvh, scale, G, BLOCK_G, D, True)
    D2: tl.constexpr = D // 2
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc_e = tl.zeros([BLOCK_G, D2], tl.float32)
    acc_o = tl.zeros([BLOCK_G, D2], tl.float32)
    for t0 in range(start, full_end, BLOCK_N):
        m_i, l_i, acc_e, acc_o = _pairs_block(
            q_e, q_o, m_i, l_i, acc_e, acc_o, t0, end, row, kvh, k_ptr, v_ptr, pt_ptr, stride_slot, stride_pt,
            scale, D2, BLOCK_N, PAGE, PTX, E5M2, False, True, OFF32,
        )  # fmt: skip
    for t0 in range(full_end, end, BLOCK_N):
        m_i, l_i, acc_e, acc_o = _pairs_block(
            q_e, q_o, m_i, l_i, acc_e, acc_o, t0, end, row, kvh, k_ptr, v_ptr, pt_ptr, stride_slot, stride_pt,
            scale, D2, BLOCK_N, PAGE, PTX, E5M2, True, True, OFF32,
        )  # fmt: skip
    inv = 1.0 / tl.maximum(l_i, 1e-30)
    lse = m_i * 0.6931471805599453 + tl.log(l_i)  # natural log, as the merge kernel takes it
    out_e, out_o = acc_e * inv[:, None], acc_o * inv[:, None]
    _store_pairs(o_ptr, lse_ptr, b, kvh, split, splits, out_e, out_o, lse, stride_o, H, D, G, BLOCK_G, SPLITS, DIRECT)
    if MERGE:
        _merge_if_last(o_ptr, lse_ptr, count_ptr, out_ptr, b, splits, stride_o, H // G * SPLITS, H, BLOCK_H, D, SPLITS)


@jit
def _merge_if_last(part_ptr, lse_ptr, count_ptr, out_ptr, b, splits, stride_o, PROGRAMS: tl.constexpr,
                   H: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr):  # fmt: skip
    """Called by each of row b's PROGRAMS programs (KV heads x launched splits) once its partial
    output and log-sum-exp are stored: it counts itself done in count_ptr[b], and the last to do
    so merges the row's `splits` partials of every head, as _merge_kernel does, into out_ptr and
    sets the count back to 0 for the next launch. The barrier orders all of this program's stores
    before its count (released at GPU scope); the merging program's count acquires every other
    program's, and it reads the partials from L2 (.cg), past its own L1."""
    tl.debug_barrier()
    if tl.atomic_add(count_ptr + b, 1, sem="acq_rel", scope="gpu") == PROGRAMS - 1:
        hd = tl.arange(0, BLOCK_H)
        sp = tl.arange(0, SPLITS)
        d = tl.arange(0, D)
        base = (b * H + hd) * SPLITS
        used = (hd[:, None] < H) & (sp[None, :] < splits)
        lse = tl.load(lse_ptr + base[:, None] + sp[None, :], mask=used, other=float("-inf"), cache_modifier=".cg")
        top = tl.where(hd < H, tl.max(lse, axis=1), 0.0)  # padded heads: weights 0, not NaN
        w = tl.exp(lse - top[:, None])
        w = w / tl.maximum(tl.sum(w, axis=1), 1e-30)[:, None]
        out = tl.zeros([BLOCK_H, D], tl.float32)
        for i in tl.static_range(SPLITS):
            w_i = tl.sum(tl.where(sp[None, :] == i, w, 0.0), axis=1)
            at = part_ptr + (base + i)[:, None] * D + d[None, :]
            part = tl.load(at, mask=(hd[:, None] < H) & (i < splits), other=0.0, cache_modifier=".cg")
            out += part * w_i[:, None]
        tl.store(out_ptr + b * stride_o + hd[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=hd[:, None] < H)  # fmt: skip
        tl.atomic_xchg(count_ptr + b, 0, sem="relaxed", scope="gpu")


def decode_attention_fp8_pairs(qkv, k_cache, v_cache, meta: StepMeta, heads: Heads, scale: float, config=None):
    """decode_attention over a token-major 8-bit cache (e4m3 or e5m2) by _decode_kernel_fp8_pairs,
    for a half-precision query (its dots run in float16); `config` overrides launch settings."""
    cfg = {**FP8_PAIRS_CONFIG, **(config or {})}
    k2, v2 = k_cache.view(torch.int16), v_cache.view(torch.int16)
    ptx = PAIRS_PTX[k_cache.dtype] if qkv.device.type == "cuda" else None
    off32 = max(k2.stride(0), v2.stride(0)) * k2.shape[0] <= OFF32_LIMIT  # every slot's offset fits in int32
    consts = dict(PTX=ptx, E5M2=k_cache.dtype == torch.float8_e5m2, OFF32=off32)
    return _split_k(_decode_kernel_fp8_pairs, qkv, k2, v2, meta, heads, scale, cfg, merge=cfg["merge"], **consts)


def check_decode_attention_fp8_pairs(fn, device, dtype, kv_dtype=None, configs=None) -> None:
    """fn (decode_attention_fp8_pairs) against the reference over the 8-bit cache, at its block
    sizes and split counts."""
    default = [(1, None), (4, None), (8, {"min_chunk": 16}), (1, {"block_n": 128}), (4, {"block_n": 32})]
    default += [(4, {"merge": "last"}), (4, {"merge": "kernel"}), (16, {"min_chunk": 16, "merge": "last"})]
    check_decode_attention(fn, device, dtype, kv_dtype or torch.float8_e4m3fn, configs or default)


CHECK_HEADS = Heads(12, 2, 128)  # a Qwen2-1.5B layer's


def random_paged_case(device, dtype, b=5, heads=CHECK_HEADS, page=16, max_len=300, kv_dtype=None):
    """A random paged KV cache with shuffled pages, row 0 at max_len tokens and the others
    shorter; returns (qkv, k_cache, v_cache, meta)."""
    h, hk, d = heads
    lens = torch.randint(1, max_len, (b,))
    lens[0] = max_len
    max_pages = -(-max_len // page)
    perm = torch.randperm(b * max_pages) + 1
    table = perm.view(b, max_pages).to(torch.int32)
    slots = (b * max_pages + 1) * page
    kc = torch.randn(slots, hk, d, device=device).to(kv_dtype or dtype)
    vc = torch.randn(slots, hk, d, device=device).to(kv_dtype or dtype)
    qkv = torch.randn(b, (h + 2 * hk) * d, device=device, dtype=dtype)
    meta = StepMeta(
        False,
        torch.zeros(b, dtype=torch.long, device=device),
        kv_cache=kc,
        rows_B=torch.arange(b, device=device),
        ctx_lens_B=lens.to(device=device, dtype=torch.int32),
        page_table=table.to(device),
        page_size=page,
        max_ctx=int(lens.max()),
        split_counts=torch.zeros(b, dtype=torch.int32, device=device),
    )
    return qkv, kc, vc, meta


def check_decode_attention(fn, device, dtype, kv_dtype=None, configs=None) -> None:
    """fn against the gathered SDPA reference at the launch settings the engine uses (`configs`:
    (splits, config) pairs instead)."""
    # block_n 64 and 128: decode_block_n picks either by the batch
    default = [(1, None), (1, {"block_n": 64}), (4, None), (4, {"block_n": 64}), (8, {"min_chunk": 16})]
    if configs is None and kv_dtype is not None:  # an fp8 cache: its float16 default and the bf16 upcast
        default += [(1, {"fp8_f16": False}), (4, {"fp8_f16": False, "block_n": 64})]
    configs = list(configs or default)
    for splits, config in configs:
        qkv, kc, vc, meta = random_paged_case(device, dtype, kv_dtype=kv_dtype)
        meta.num_splits = splits
        got = fn(qkv, kc, vc, meta, CHECK_HEADS, 128**-0.5, **({"config": config} if config else {}))
        ref = decode_attention(qkv, kc, vc, meta, CHECK_HEADS, 128**-0.5)
        expect_near(got, ref, dtype, f"decode_attention splits={splits}")
        if meta.split_counts.any():  # the next launch counts from 0
            raise Mismatch(f"decode_attention splits={splits} left split counts {meta.split_counts.tolist()}")
