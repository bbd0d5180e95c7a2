"""Triton kernels for the engine's hot path on GPU; ops_torch.py defines what each computes.

Decode of a small model is a chain of many small operations; fusing each norm, the rotary + KV
write, and the gated activation into one kernel keeps the CUDA graph short (about ten kernels a
layer). Decode attention reads the KV cache through the page table in split-K fashion (several
programs per row and KV head, merged by a second kernel), so short batches still fill the GPU.
The sampler reads the logits once for per-chunk statistics (max, sum of exponentials, argmax),
then draws each row's token by inverse transform from those and one re-read chunk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minirl_plugins.engines.native.layers import ops_torch
from minirl_plugins.engines.native.layers.meta import StepMeta, multiprocessors


def _pow2(n: int) -> int:
    return triton.next_power_of_2(n)


@triton.jit
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


def rmsnorm(x, weight, eps):
    y = torch.empty_like(x)
    x2, y2 = x.view(-1, x.shape[-1]), y.view(-1, x.shape[-1])
    _rmsnorm_kernel[(x2.shape[0],)](
        x2,
        x2,
        weight,
        y2,
        x2.shape[1],
        x2.stride(0),
        x2.stride(0),
        y2.stride(0),
        eps,
        HAS_RESIDUAL=False,
        BLOCK=_pow2(x2.shape[1]),
    )
    return y


def add_rmsnorm(x, residual, weight, eps):
    """In place: residual <- x + residual; returns (rmsnorm(residual), residual)."""
    y = torch.empty_like(x)
    _rmsnorm_kernel[(x.shape[0],)](
        x,
        residual,
        weight,
        y,
        x.shape[1],
        x.stride(0),
        residual.stride(0),
        y.stride(0),
        eps,
        HAS_RESIDUAL=True,
        BLOCK=_pow2(x.shape[1]),
    )
    return y, residual


@triton.jit
def _silu_mul_kernel(gu_ptr, y_ptr, n_cols, stride_gu, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + n_cols + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (act * u.to(tl.float32)).to(g.dtype), mask=mask)


def silu_mul(gate_up):
    n, two_i = gate_up.shape
    y = torch.empty(n, two_i // 2, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(n, triton.cdiv(two_i // 2, block))](
        gate_up, y, two_i // 2, gate_up.stride(0), y.stride(0), BLOCK=block
    )
    return y


@triton.jit
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
    stride_tok,
    stride_slot,
    eps,
    H: tl.constexpr,
    HK: tl.constexpr,
    D: tl.constexpr,
    HALF: tl.constexpr,
    QK_NORM: tl.constexpr,
    KV_MAX: tl.constexpr,
):
    # KV_MAX > 0: an 8-bit float cache, written with scale 1 and clamped to its largest value
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
        tl.store(v_cache_ptr + dst + offs, _to_cache(tl.load(v + offs), kv_t, KV_MAX))
        tl.store(v_cache_ptr + dst + HALF + offs, _to_cache(tl.load(v + HALF + offs), kv_t, KV_MAX))


@triton.jit
def _to_cache(x, kv_t: tl.constexpr, KV_MAX: tl.constexpr):
    """ops_torch.to_cache: the cache's dtype, clamped to KV_MAX when that is an 8-bit float's."""
    if KV_MAX > 0:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -KV_MAX), KV_MAX)
    return x.to(kv_t)


def rope_store(
    qkv,
    positions,
    cos,
    sin,
    slot_mapping,
    k_cache,
    v_cache,
    heads,
    kv_heads,
    head_dim,
    q_norm=None,
    k_norm=None,
    eps=1e-6,
):
    assert head_dim % 2 == 0 and (head_dim // 2) & (head_dim // 2 - 1) == 0, "head_dim/2 must be a power of 2"
    norm = q_norm is not None
    _rope_store_kernel[(qkv.shape[0], heads + kv_heads)](
        qkv,
        positions,
        cos,
        sin,
        slot_mapping,
        k_cache,
        v_cache,
        q_norm if norm else qkv,
        k_norm if norm else qkv,
        qkv.stride(0),
        k_cache.stride(0),
        eps,
        H=heads,
        HK=kv_heads,
        D=head_dim,
        HALF=head_dim // 2,
        QK_NORM=norm,
        KV_MAX=ops_torch.cache_limit(k_cache.dtype),
    )


# Decode attention launch settings. SPLITS (the most programs per row and KV head) is fixed
# per CUDA-graph bucket by the runner; a row uses fewer when its context is short (min_chunk
# tokens per split at least), since each split costs a partial write and a merge.
# Chosen by a sweep on an H200 (scripts/bench_rollout.py --sweep-attention): one split
# whenever batch x KV heads fills the SMs; the block size by decode_block_n.
# fp8_f16: an fp8 cache's keys and values are upcast to float16 (one native conversion on Hopper)
# and the dots run in float16, instead of upcasting to the queries' bfloat16.
DECODE_CONFIG = {"block_n": 128, "num_warps": 4, "num_stages": 2, "min_chunk": 256, "fp8_f16": False}
# An fp8 cache: float16 dots over 32-key blocks in three stages were the fastest setting at both
# shapes swept on an H200, where the bf16 cache's settings (decode_block_n) were slow. Batch 256 x
# context 600: 40.5 us against 62.0 (a bf16 cache: 42.4); 64 x 14,000, 4 splits: 210.5 against
# 315.5 (a bf16 cache: 217.8). Either way an 8-bit cache is read at about half the bandwidth.
FP8_DECODE_CONFIG = {"block_n": 32, "num_stages": 3, "fp8_f16": True}


def decode_block_n(programs: int, device: torch.device) -> int:
    """Keys per block of decode attention, from the H200 sweep (docs/benchmarks.md): 64-key
    blocks read the cache fastest when the programs (rows x KV heads x splits) make 3 to 6 of the
    multiprocessor count (batch 256 at 2 KV heads: 13% faster at contexts 600 and 1,000), 128-key
    blocks below (batch 128: 10% faster) and above (batch 512: 2% faster)."""
    if device.type != "cuda":
        return DECODE_CONFIG["block_n"]
    sms = multiprocessors(device)
    return 64 if 3 * sms <= programs < 6 * sms else DECODE_CONFIG["block_n"]


@triton.jit
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
    length = tl.load(lens_ptr + b)
    splits = tl.minimum(tl.maximum(tl.cdiv(length, min_chunk), 1), SPLITS)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    n = tl.arange(0, BLOCK_N)
    heads = kvh * G + g
    q = tl.load(q_ptr + b * stride_q + heads[:, None] * D + d[None, :], mask=g[:, None] < G, other=0.0)
    if KV_F16:  # an fp8 cache read through float16 (clamped to its range), not bfloat16
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    chunk = tl.cdiv(tl.cdiv(length, splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.where(split < splits, tl.minimum(length, start + chunk), start)
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


@triton.jit
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


def decode_attention(qkv, k_cache, v_cache, meta: StepMeta, heads, kv_heads, head_dim, scale, config=None):
    """Paged decode attention; k_cache/v_cache are [K, Hk, D] views of one layer."""
    b = qkv.shape[0]
    group = heads // kv_heads
    splits = meta.num_splits
    fp8 = k_cache.dtype.itemsize == 1
    launch = FP8_DECODE_CONFIG if fp8 else {"block_n": decode_block_n(b * kv_heads * splits, qkv.device)}
    cfg = {**DECODE_CONFIG, **launch, **(config or {})}
    out = torch.empty(b, heads * head_dim, dtype=qkv.dtype, device=qkv.device)
    if splits == 1:
        part, lse = out, out
    else:
        part = torch.empty(b * heads * splits, head_dim, dtype=torch.float32, device=qkv.device)
        lse = torch.empty(b * heads * splits, dtype=torch.float32, device=qkv.device)
    _decode_kernel[(b, kv_heads, splits)](
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
        H=heads,
        D=head_dim,
        G=group,
        BLOCK_G=max(16, _pow2(group)),
        BLOCK_N=cfg["block_n"],
        PAGE=meta.page_size,
        SPLITS=splits,
        DIRECT=splits == 1,
        PRECISION="ieee" if qkv.dtype == torch.float32 else "tf32",
        KV_F16=fp8 and bool(cfg["fp8_f16"]) and qkv.dtype == torch.bfloat16,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    if splits > 1:
        _merge_kernel[(b, heads)](
            part, lse, meta.ctx_lens_B, out, out.stride(0), cfg["min_chunk"], H=heads, D=head_dim, SPLITS=splits
        )
    return out


@triton.jit
def _chunk_stats_kernel(
    logits_ptr, stride_row, vocab, params_ptr, max_ptr, sum_ptr, idx_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr
):
    """One vocabulary chunk of one row: max, sum of exp(x - max) and the first argmax of the
    temperature-scaled logits x. One exp per entry: the running per-lane sum s is rescaled only
    when x raises the lane's max m, so e = exp(-|x - m|) serves both cases."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    inv_temp = tl.load(params_ptr)
    lanes = tl.arange(0, BLOCK)
    m_vec = tl.full([BLOCK], -1e30, tl.float32)
    s_vec = tl.zeros([BLOCK], tl.float32)
    i_vec = tl.zeros([BLOCK], tl.int32)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    for off in range(c * CHUNK, c * CHUNK + CHUNK, BLOCK):
        cols = off + lanes
        x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32) * inv_temp
        d = x - m_vec
        e = tl.exp(-tl.abs(d))
        up = d > 0
        s_vec = tl.where(up, s_vec * e + 1.0, s_vec + e)
        i_vec = tl.where(up, cols, i_vec)
        m_vec = tl.maximum(m_vec, x)
    m = tl.max(m_vec, axis=0)
    out = row * tl.num_programs(1) + c
    tl.store(max_ptr + out, m)
    tl.store(sum_ptr + out, tl.sum(s_vec * tl.exp(m_vec - m), axis=0))
    tl.store(idx_ptr + out, tl.min(tl.where(m_vec == m, i_vec, 2147483647), axis=0))


@triton.jit
def _sample_pick_kernel(
    logits_ptr,
    stride_row,
    vocab,
    params_ptr,
    seed_ptr,
    max_ptr,
    sum_ptr,
    idx_ptr,
    tokens_ptr,
    logprobs_ptr,
    CHUNKS,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNKS_P2: tl.constexpr,
):
    """One row: the log-sum-exp from the chunk statistics, then the token. Greedy: the first
    argmax. Sampling: inverse transform in two levels with two independent uniforms, a chunk with
    probability mass_c / total, then a column of it with probability exp(x_i) / mass_c."""
    row = tl.program_id(0)
    inv_temp = tl.load(params_ptr)
    sampling = tl.load(params_ptr + 1) > 0
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    cs = tl.arange(0, CHUNKS_P2)
    live = cs < CHUNKS
    pm = tl.load(max_ptr + row * CHUNKS + cs, mask=live, other=-1e30)
    own = tl.load(sum_ptr + row * CHUNKS + cs, mask=live, other=0.0)  # relative to the chunk's max
    m = tl.max(pm, axis=0)
    w = own * tl.exp(pm - m)
    total = tl.sum(w, axis=0)
    lse = m + tl.log(total)
    pidx = tl.load(idx_ptr + row * CHUNKS + cs, mask=live, other=2147483647)
    token = tl.min(tl.where(pm == m, pidx, 2147483647), axis=0)
    if sampling:
        seed = (tl.load(seed_ptr) * 1000003 + tl.load(seed_ptr + 1) * 7919) % 2147483647
        r0, r1, _, _ = tl.randint4x(seed, row)
        exact, loose = _crossing(tl.cumsum(w, axis=0), w, tl.random.uint_to_uniform_float(r0) * total, cs)
        last_chunk = tl.max(tl.where(w > 0, cs, 0), axis=0)
        chunk = tl.where(exact < 2147483647, exact, tl.minimum(loose, last_chunk))
        cm = tl.sum(tl.where(cs == chunk, pm, 0.0), axis=0)
        target = tl.random.uint_to_uniform_float(r1) * tl.sum(tl.where(cs == chunk, own, 0.0), axis=0)
        lanes = tl.arange(0, BLOCK)
        seen = 0.0
        first = 2147483647
        fallback = 2147483647
        last = 0
        for off in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
            cols = off + lanes
            x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            e = tl.exp(x * inv_temp - cm)
            exact, loose = _crossing(tl.cumsum(e, axis=0) + seen, e, target, cols)
            first = tl.minimum(first, exact)
            fallback = tl.minimum(fallback, loose)
            last = tl.maximum(last, tl.max(tl.where(e > 0, cols, 0), axis=0))
            seen += tl.sum(e, axis=0)
        token = tl.where(first < 2147483647, first, tl.minimum(fallback, last))
    chosen = tl.load(row_ptr + token).to(tl.float32) * inv_temp
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(logprobs_ptr + row, chosen - lse)


@triton.jit
def _crossing(cum, mass, target, idx):
    """Inverse transform over lanes with masses `mass` and (scanned) cumulative sums `cum`:
    (exact, loose) = the first idx whose interval [cum - mass, cum) holds target, and the first
    whose cum passes it; 2**31 - 1 where none. Only lanes with mass qualify: a parallel scan can
    leave an empty lane's cum an ulp above its neighbour's, which must not make it drawable, and
    the exact test keeps a lane far below the chunk's max (mass under an ulp of cum) from taking
    such an ulp either. loose covers the scan's rounding gaps between intervals."""
    has = (mass > 0) & (cum > target)
    exact = tl.min(tl.where(has & (cum - mass <= target), idx, 2147483647), axis=0)
    return exact, tl.min(tl.where(has, idx, 2147483647), axis=0)


def sample_params(temperature: float, device) -> torch.Tensor:
    """The device-side parameters sample_from reads: (1/temperature, sample?) in float32."""
    sampling = temperature > 0
    return torch.tensor([1.0 / temperature if sampling else 1.0, float(sampling)], device=device)


def sample_from(logits_MV, params: torch.Tensor, seed: torch.Tensor):
    """Sample one token per row with device-side parameters; advances seed[1] (the step) by one.

    Plain temperature sampling (no top-k/top-p), graph-capturable: returns (tokens_M int64,
    logprobs_M float32), the same distribution and log-probs as ops_torch.sample. Two kernels:
    per-chunk statistics over the whole vocabulary (one exp per entry, no random numbers), then
    per row the log-sum-exp and an inverse-transform draw that reads one chunk again. Its draw is
    the softmax's up to float32 rounding of the cumulative sums: a token whose probability is
    under about 1e-7 of its chunk's mass is drawn at a rounded rate (Gumbel-max draws it almost
    never), and none without mass is ever drawn.
    """
    m, vocab = logits_MV.shape
    block = 1024 if vocab >= 1024 else max(2, _pow2(vocab))
    chunk = triton.cdiv(triton.cdiv(vocab, max(1, min(32, triton.cdiv(vocab, 4096)))), block) * block
    chunks = triton.cdiv(vocab, chunk)  # none empty
    f32 = dict(dtype=torch.float32, device=logits_MV.device)
    part_max, part_sum = torch.empty(m, chunks, **f32), torch.empty(m, chunks, **f32)
    part_idx = torch.empty(m, chunks, dtype=torch.int32, device=logits_MV.device)
    stride = logits_MV.stride(0)
    _chunk_stats_kernel[(m, chunks)](
        logits_MV, stride, vocab, params, part_max, part_sum, part_idx, CHUNK=chunk, BLOCK=block
    )
    tokens = torch.empty(m, dtype=torch.int64, device=logits_MV.device)
    logprobs = torch.empty(m, **f32)
    _sample_pick_kernel[(m,)](
        logits_MV,
        stride,
        vocab,
        params,
        seed,
        part_max,
        part_sum,
        part_idx,
        tokens,
        logprobs,
        chunks,
        CHUNK=chunk,
        BLOCK=block,
        CHUNKS_P2=_pow2(chunks),
    )
    seed[1:].add_(1)
    return tokens, logprobs


def sample(logits_MV, temperature: float, seed: int):
    """sample_from with host-side parameters (self-checks and tests)."""
    seed_t = torch.tensor([seed, 0], dtype=torch.int64, device=logits_MV.device)
    return sample_from(logits_MV, sample_params(temperature, logits_MV.device), seed_t)
