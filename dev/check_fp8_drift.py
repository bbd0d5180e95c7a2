"""Greedy log-prob drift of the native engine's decode kernels against its torch reference, per KV
cache format, on the tiny model of tests/unit/test_native_gpu.py (CUDA graphs).

    python3 dev/check_fp8_drift.py

For each cache (bf16, fp8, fp8_e5m2) and decode kernel (the engine's choice, and over an 8-bit
cache also the dequantizing one): the largest |log-prob difference| before the greedy
continuations part, and the mean share of tokens before they part.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, ".")
from minirl_plugins.engines.native import build_native_engine  # noqa: E402
from minirl_plugins.engines.native.layers import paged_attention as pa  # noqa: E402
from tests.tiny_models import PROMPTS, engine_context, greedy, tiny_config, tiny_hf_model  # noqa: E402


def drift(got, want) -> tuple[float, float]:
    worst, shared = 0.0, []
    for g, w in zip(got, want):
        same = next((i for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids)) if a != b), len(w.token_ids))
        if same:
            worst = max(worst, max(abs(a - b) for a, b in zip(g.logprobs[:same], w.logprobs[:same])))
        shared.append(same / len(w.token_ids))
    return worst, sum(shared) / len(shared)


def main() -> None:
    cfg = tiny_config("qwen2", hidden_size=256, num_attention_heads=8, num_key_value_heads=2)
    hf = tiny_hf_model(cfg, seed=2, std=0.2, device="cuda", dtype=torch.bfloat16)
    ctx = dict(actor=hf, device="cuda", dtype=torch.bfloat16, num_kv_pages=512)
    print("| cache | decode kernel | max log-prob diff before parting | shared share |")
    for kv in ("auto", "fp8", "fp8_e5m2"):
        rollout = SimpleNamespace(kv_cache_dtype=kv)
        ref = build_native_engine(rollout, engine_context(cfg, use_triton=False, **ctx))
        want = ref.generate(PROMPTS, greedy(n=2, max_new=32))
        kernels = [None] if kv == "auto" else [None, pa.decode_attention_triton]
        for kernel in kernels:
            eng = build_native_engine(rollout, engine_context(cfg, **ctx))
            if kernel is not None:
                eng.ops.decode_attention = kernel
            label = eng.ops.chosen.get("decode_attention") if kernel is None else "dequantizing"
            worst, shared = drift(eng.generate(PROMPTS, greedy(n=2, max_new=32)), want)
            print(f"| {kv} | {label} | {worst:.3f} | {shared:.2f} |", flush=True)


if __name__ == "__main__":
    main()
