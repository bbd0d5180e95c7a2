"""Sampling one token per row with its log-prob: the torch sampler and the fused Triton sampler.

The torch sampler (`sample`) does everything (temperature, top-k/top-p, a seeded exponential
race) on the host's schedule. The fused sampler (`fast_sample`) does plain temperature sampling
with its parameters and seed in device buffers, so it runs inside the decode step's CUDA graph.
SamplerState picks between them for one generate call.
"""

from __future__ import annotations

import torch

from minirl.kernels.selfcheck import Mismatch, expect_near
from minirl.protocols import SamplingParams
from minirl_plugins.engines.native.layers.jit import jit, tl, triton


def sample(logits_MV, temperature: float, top_k: int, top_p: float, generator):
    """Sample one token per row; returns (tokens_M int64, logprobs_M float32).

    logprobs are of the sampled tokens under the temperature-scaled logits, before top-k/top-p
    (temperature 0: greedy, log-probs of the raw logits). Sampling uses the exponential race:
    argmax(p / E) with E ~ Exp(1) picks token i with probability p_i.
    """
    x = logits_MV.float()
    if temperature > 0:
        x = x / temperature
    logp = torch.log_softmax(x, dim=-1)
    if temperature <= 0:
        tokens = x.argmax(dim=-1)
    else:
        probs = torch.softmax(filter_top_k_top_p(x, top_k, top_p), dim=-1)
        race = torch.empty_like(probs).exponential_(generator=generator)
        tokens = (probs / race).argmax(dim=-1)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def filter_top_k_top_p(x_MV, top_k: int, top_p: float) -> torch.Tensor:
    """Logits with the tokens outside the top-k and outside the top-p nucleus set to -inf."""
    if 0 < top_k < x_MV.shape[-1]:
        kth = torch.topk(x_MV, top_k, dim=-1).values[:, -1:]
        x_MV = x_MV.masked_fill(x_MV < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x_MV, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above
        sorted_x = sorted_x.masked_fill(before >= top_p, float("-inf"))
        x_MV = torch.empty_like(x_MV).scatter_(1, order, sorted_x)
    return x_MV


@jit
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


@jit
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


@jit
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
    """The device-side parameters fast_sample reads: (1/temperature, sample?) in float32."""
    sampling = temperature > 0
    return torch.tensor([1.0 / temperature if sampling else 1.0, float(sampling)], device=device)


def fast_sample(logits_MV, params: torch.Tensor, seed: torch.Tensor):
    """Sample one token per row with device-side parameters; advances seed[1] (the step) by one.

    Plain temperature sampling (no top-k/top-p), graph-capturable: returns (tokens_M int64,
    logprobs_M float32), the same distribution and log-probs as `sample`. Two kernels:
    per-chunk statistics over the whole vocabulary (one exp per entry, no random numbers), then
    per row the log-sum-exp and an inverse-transform draw that reads one chunk again. Its draw is
    the softmax's up to float32 rounding of the cumulative sums: a token whose probability is
    under about 1e-7 of its chunk's mass is drawn at a rounded rate (Gumbel-max draws it almost
    never), and none without mass is ever drawn.
    """
    m, vocab = logits_MV.shape
    block = 1024 if vocab >= 1024 else max(2, triton.next_power_of_2(vocab))
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
        CHUNKS_P2=triton.next_power_of_2(chunks),
    )
    seed[1:].add_(1)
    return tokens, logprobs


def fast_sample_once(logits_MV, temperature: float, seed: int, sampler=None):
    """fast_sample (or `sampler`, a candidate under check) with host-side parameters: tests and
    self-checks."""
    seed_2 = torch.tensor([seed, 0], dtype=torch.int64, device=logits_MV.device)
    return (sampler or fast_sample)(logits_MV, sample_params(temperature, logits_MV.device), seed_2)


def check_fast_sample(fn, device, dtype, kv_dtype=None) -> None:
    logits = (torch.randn(7, 5000, device=device) * 3).to(dtype)
    tok, lp = fast_sample_once(logits, 0.0, 1, fn)
    ref_tok, ref_lp = sample(logits, 0.0, -1, 1.0, None)
    if not torch.equal(tok, ref_tok):
        raise Mismatch("disagrees with its torch reference (greedy tokens differ)")
    expect_near(lp, ref_lp, torch.float32, "greedy logprobs")
    tok, lp = fast_sample_once(logits, 0.7, 5, fn)
    ref = torch.log_softmax(logits.float() / 0.7, -1).gather(1, tok[:, None]).squeeze(1)
    expect_near(lp, ref, torch.float32, "sampled logprobs")


class SamplerState:
    """Samples one token per logits row on the device, reproducibly from `seed`, for one generate.

    Plain temperature sampling goes to the fused sampler (`fused`, fast_sample) when there is one:
    it reads its parameters and seed from the device `buffers`, so it runs inside the decode
    step's CUDA graph. Top-k/top-p (which need a sort) and CPU runs use `sample` with a seeded
    generator, outside the graph.
    """

    def __init__(self, params: SamplingParams, seed: int, device: torch.device, fused, buffers):
        self.temperature, self.top_k, self.top_p = params.temperature, params.top_k, params.top_p
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.fused = None if self.top_k > 0 or self.top_p < 1.0 else fused
        self.params, self.seed = buffers
        if self.fused is not None:
            self.params.copy_(sample_params(self.temperature, "cpu"))
            self.seed.copy_(torch.tensor([seed, 0], dtype=torch.int64))

    def sample(self, logits_MV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens_M int64, logprobs_M float32) of one step, outside any graph."""
        if self.fused is not None:
            return self.fused(logits_MV, self.params, self.seed)
        return sample(logits_MV, self.temperature, self.top_k, self.top_p, self.generator)
