"""Reference implementations of the engine's fused operations, in plain PyTorch.

They run everywhere (CPU tests, the CPU profile, GPUs without Triton) and define what the Triton
kernels in ops_triton.py must compute. Rounding follows transformers: norms and rotary in float32,
results rounded to the model dtype where transformers rounds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minirl_plugins.engines.native.layers.meta import StepMeta


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def add_rmsnorm(x, residual, weight, eps):
    """residual <- x + residual; returns (rmsnorm(residual), residual)."""
    residual = x + residual
    return rmsnorm(residual, weight, eps), residual


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rotate(x, cos, sin):
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


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
    """In place on qkv_N(H+2Hk)D: (q/k norm,) rotary on q and k; k and v written to the cache."""
    n = qkv.shape[0]
    q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
    q = qkv[:, :q_end].view(n, heads, head_dim)
    k = qkv[:, q_end:k_end].view(n, kv_heads, head_dim)
    v = qkv[:, k_end:].view(n, kv_heads, head_dim)
    if q_norm is not None:
        q, k = rmsnorm(q, q_norm, eps), rmsnorm(k, k_norm, eps)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    q, k = _rotate(q, c, s), _rotate(k, c, s)
    qkv[:, :q_end] = q.reshape(n, q_end)
    qkv[:, q_end:k_end] = k.reshape(n, k_end - q_end)
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


def split_qkv(qkv, heads, kv_heads, head_dim):
    n = qkv.shape[0]
    q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
    return (
        qkv[:, :q_end].view(n, heads, head_dim),
        qkv[:, q_end:k_end].view(n, kv_heads, head_dim),
        qkv[:, k_end:].view(n, kv_heads, head_dim),
    )


def prefill_attention(qkv, meta: StepMeta, heads, kv_heads, head_dim, scale):
    """Causal attention within each packed sequence, one SDPA call per sequence."""
    q, k, v = split_qkv(qkv, heads, kv_heads, head_dim)
    out = torch.empty(qkv.shape[0], heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    start = 0
    for length in meta.seqlens:
        sl = slice(start, start + length)
        o = F.scaled_dot_product_attention(
            q[sl].transpose(0, 1),
            k[sl].transpose(0, 1),
            v[sl].transpose(0, 1),
            is_causal=True,
            scale=scale,
            enable_gqa=heads != kv_heads,
        )
        out[sl] = o.transpose(0, 1)
        start += length
    return out.view(-1, heads * head_dim)


def decode_attention(qkv, k_cache, v_cache, meta: StepMeta, heads, kv_heads, head_dim, scale):
    """One query per row over its cached keys: gather the rows' pages, mask, SDPA."""
    q = qkv[:, : heads * head_dim].view(-1, heads, 1, head_dim)
    max_ctx = meta.max_ctx or int(meta.ctx_lens_B.max())
    pos_T = torch.arange(max_ctx, device=qkv.device)
    pages_BT = meta.page_table[meta.rows_B][:, pos_T // meta.page_size].long()
    slots_BT = pages_BT * meta.page_size + pos_T % meta.page_size
    k = k_cache[slots_BT].to(q.dtype).transpose(1, 2)  # B Hk T D
    v = v_cache[slots_BT].to(q.dtype).transpose(1, 2)
    mask = (pos_T[None, :] < meta.ctx_lens_B[:, None])[:, None, None, :]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=heads != kv_heads)
    return o.reshape(-1, heads * head_dim)


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
