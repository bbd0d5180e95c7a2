"""Picks the implementation of each fused operation: Triton on CUDA when it checks out, else torch.

Every Triton kernel and torch's varlen attention is first run on small random inputs next to its
pure-torch reference (ops_torch.py). A kernel that fails to compile or disagrees is replaced by
the reference with a warning, so a broken kernel costs speed, never correctness.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from minirl_plugins.engines.native.layers import ops_torch
from minirl_plugins.engines.native.layers.meta import StepMeta

NAMES = ("rmsnorm", "add_rmsnorm", "silu_mul", "rope_store", "prefill_attention", "decode_attention")


@dataclass
class Ops:
    rmsnorm: Callable = ops_torch.rmsnorm
    add_rmsnorm: Callable = ops_torch.add_rmsnorm
    silu_mul: Callable = ops_torch.silu_mul
    rope_store: Callable = ops_torch.rope_store
    prefill_attention: Callable = ops_torch.prefill_attention
    decode_attention: Callable = ops_torch.decode_attention
    fast_sample: Callable | None = None  # (logits, params, seed) -> (tokens, logprobs); ops_triton.sample_from
    chosen: dict = field(default_factory=dict)

    @property
    def graphable(self) -> bool:
        """The torch decode attention reads the longest context on the host: no CUDA graphs."""
        return self.decode_attention is not ops_torch.decode_attention


def select_ops(
    device: torch.device, dtype: torch.dtype, use_triton: bool = True, kv_dtype: torch.dtype | None = None
) -> Ops:
    """kv_dtype: the KV cache's (rollout.kv_cache_dtype), when it is not `dtype`."""
    ops = Ops()
    if device.type != "cuda":
        return ops
    # (name, implementation), best first: the first that passes its check is used
    candidates = [
        ("prefill_attention", _varlen_prefill(repeat_kv=False)),
        ("prefill_attention", _varlen_prefill(repeat_kv=True)),
    ]
    if use_triton:
        try:
            from minirl_plugins.engines.native.layers import ops_triton
        except Exception as exc:  # triton missing or broken
            warnings.warn(f"native engine: Triton unavailable ({exc}); using pure-torch kernels")
        else:
            candidates += [(n, getattr(ops_triton, n)) for n in NAMES if n != "prefill_attention"]
            candidates.append(("fast_sample", ops_triton.sample_from))
    for name, fn in candidates:
        if fn is None or name in ops.chosen:
            continue
        try:
            CHECKS[name](fn, device, dtype, kv_dtype or dtype)
        except Exception as exc:
            warnings.warn(
                f"native engine: {name} kernel {getattr(fn, '__module__', '?')} rejected "
                f"({type(exc).__name__}: {str(exc)[:200]}); trying the next or torch"
            )
            continue
        setattr(ops, name, fn)
        ops.chosen[name] = getattr(fn, "__module__", "?").rsplit(".", 1)[-1]
    return ops


def _varlen_prefill(repeat_kv: bool):
    """torch's varlen flash attention (torch >= 2.10), adapted to the signature of the installed torch.

    Without an `enable_gqa` argument (torch 2.10/2.11), grouped KV heads are first tried as they
    are (the flash kernel underneath handles them) and else repeated to the query heads.
    """
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    native_gqa = "enable_gqa" in params
    if native_gqa and repeat_kv:
        return None

    def prefill_attention(qkv, meta: StepMeta, heads, kv_heads, head_dim, scale):
        q, k, v = (t.contiguous() for t in ops_torch.split_qkv(qkv, heads, kv_heads, head_dim))
        extra = dict(causal)
        if heads != kv_heads and native_gqa:
            extra["enable_gqa"] = True
        elif heads != kv_heads and repeat_kv:
            k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        if "scale" in params:
            extra["scale"] = scale
        cu = meta.cu_seqlens_S1
        out = varlen_attn(q, k, v, cu, cu, meta.max_seqlen, meta.max_seqlen, **extra)
        return out.reshape(-1, heads * head_dim)

    prefill_attention.__module__ = "torch_varlen" + ("_repeat_kv" if repeat_kv else "")
    return prefill_attention


# --------------------------------------------------------------------------------------------
# self-checks: random inputs, compared with the pure-torch reference
# --------------------------------------------------------------------------------------------


def _close(a, b, dtype, what):
    a, b = a.float(), b.float()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    err = ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
    if not err < tol:  # also catches NaN
        raise AssertionError(f"{what}: relative error {err:.2e} > {tol:.0e}")


def _check_norms(fn, device, dtype, kv_dtype=None, residual: bool = False):
    x = torch.randn(37, 200, device=device, dtype=dtype)
    r = torch.randn_like(x)
    w = torch.rand(200, device=device, dtype=dtype) + 0.5
    if residual:
        y, r2 = fn(x, r.clone(), w, 1e-6)
        y_ref, r_ref = ops_torch.add_rmsnorm(x, r, w, 1e-6)
        _close(r2, r_ref, dtype, "residual")
    else:
        y, y_ref = fn(x, w, 1e-6), ops_torch.rmsnorm(x, w, 1e-6)
    _close(y, y_ref, dtype, "rmsnorm")


def _check_silu(fn, device, dtype, kv_dtype=None):
    gu = torch.randn(19, 2 * 1500, device=device, dtype=dtype)
    _close(fn(gu), ops_torch.silu_mul(gu), dtype, "silu_mul")


def _check_rope(fn, device, dtype, kv_dtype=None):
    n, h, hk, d, slots = 29, 6, 2, 128, 64
    for norm in (False, True):
        qkv = torch.randn(n, (h + 2 * hk) * d, device=device, dtype=dtype)
        pos = torch.randint(0, 100, (n,), device=device)
        ang = torch.rand(100, d // 2, device=device) * 6
        slot = torch.randperm(slots, device=device)[:n]
        qw = kw = None
        if norm:
            qw, kw = (torch.rand(d, device=device, dtype=dtype) + 0.5 for _ in range(2))
        outs = []
        for f in (fn, ops_torch.rope_store):
            buf, kc, vc = qkv.clone(), torch.zeros(slots, hk, d, device=device, dtype=kv_dtype or dtype), None
            vc = torch.zeros_like(kc)
            f(buf, pos, ang.cos(), ang.sin(), slot, kc, vc, h, hk, d, qw, kw, 1e-6)
            outs.append((buf, kc, vc))
        for got, ref in zip(outs[0], outs[1]):
            _close(got, ref, dtype, "rope_store")


def random_paged_case(device, dtype, b=5, h=12, hk=2, d=128, page=16, max_len=300, kv_dtype=None):
    """A random paged KV cache with shuffled pages; returns (qkv, k_cache, v_cache, meta)."""
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
    )
    return qkv, kc, vc, meta


def _check_decode(fn, device, dtype, kv_dtype=None):
    # block_n 64 and 128: decode_block_n picks either by the batch
    configs = [(1, None), (1, {"block_n": 64}), (4, None), (4, {"block_n": 64}), (8, {"min_chunk": 16})]
    if kv_dtype is not None:  # an fp8 cache: its float16 default (FP8_DECODE_CONFIG) and the bf16 upcast
        configs += [(1, {"fp8_f16": False}), (4, {"fp8_f16": False, "block_n": 64})]
    for splits, config in configs:
        qkv, kc, vc, meta = random_paged_case(device, dtype, kv_dtype=kv_dtype)
        meta.num_splits = splits
        got = fn(qkv, kc, vc, meta, 12, 2, 128, 128**-0.5, **({"config": config} if config else {}))
        ref = ops_torch.decode_attention(qkv, kc, vc, meta, 12, 2, 128, 128**-0.5)
        _close(got, ref, dtype, f"decode_attention splits={splits}")


def _check_prefill(fn, device, dtype, kv_dtype=None):
    lens = [5, 130, 1, 64]
    h, hk, d = 12, 2, 128
    qkv = torch.randn(sum(lens), (h + 2 * hk) * d, device=device, dtype=dtype)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)
    meta = StepMeta(True, cu, None, cu_seqlens_S1=cu, seqlens=lens, max_seqlen=max(lens))
    _close(
        fn(qkv, meta, h, hk, d, d**-0.5),
        ops_torch.prefill_attention(qkv, meta, h, hk, d, d**-0.5),
        dtype,
        "prefill_attention",
    )


def _check_sample(sample_from, device, dtype, kv_dtype=None):
    def fn(logits, temperature, seed):
        params = torch.tensor([1 / temperature if temperature > 0 else 1.0, float(temperature > 0)], device=device)
        return sample_from(logits, params, torch.tensor([seed, 0], device=device))

    logits = (torch.randn(7, 5000, device=device) * 3).to(dtype)
    tok, lp = fn(logits, 0.0, 1)
    ref_tok, ref_lp = ops_torch.sample(logits, 0.0, -1, 1.0, None)
    if not torch.equal(tok, ref_tok):
        raise AssertionError("greedy tokens differ")
    _close(lp, ref_lp, torch.float32, "greedy logprobs")
    tok, lp = fn(logits, 0.7, 5)
    ref = torch.log_softmax(logits.float() / 0.7, -1).gather(1, tok[:, None]).squeeze(1)
    _close(lp, ref, torch.float32, "sampled logprobs")


CHECKS = {
    "rmsnorm": lambda fn, dev, dt, kv_dt=None: _check_norms(fn, dev, dt, residual=False),
    "add_rmsnorm": lambda fn, dev, dt, kv_dt=None: _check_norms(fn, dev, dt, residual=True),
    "silu_mul": _check_silu,
    "rope_store": _check_rope,
    "decode_attention": _check_decode,
    "prefill_attention": _check_prefill,
    "fast_sample": _check_sample,
}
