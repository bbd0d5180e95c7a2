"""The GRPO step's phases against their floors, by count (no GPU needed).

    python3 dev/step_floors.py                                  # the 32 x 8 x 1,024 workload
    python3 dev/step_floors.py --prompts 32 --n 16 --mini-batches 4 --prev-pass   # the `h200` profile
    python3 dev/step_floors.py --prompts 4 --n 16 --prompt-len 100 --response-len 27648 --kv-cache fp8 --fp8-gemms
                                                                # the 28k step's generation, fp8 cache and GEMMs

A phase's floor is its time with every kernel at a ceiling of the H200 (4.28 TB/s measured copy
bandwidth, 768 TFLOP/s measured bf16 matmul), summed kernel by kernel, with no gaps between them:
- a decode step: each GEMM at max(FLOPs / 768 TFLOP/s, weight bytes / 4.28 TB/s) (at 256 rows
  gate/up, down and the head are compute-bound), decode attention at its live KV bytes / 4.28
  TB/s, the sampler reading the float32 logits once; the prefill's GEMMs at the matmul ceiling;
- a log-prob pass and the update: the GEMMs (2·N FLOPs a token forward, 4·N more backward; N
  the non-embedding parameters plus the head, as the MFU counts them) at the matmul ceiling;
  causal attention at the rate torch's FA2 varlen kernel measured in the profiles of
  docs/benchmarks.md (ATTENTION_RATE; `--attention-rate 768` puts it at the matmul ceiling, a
  bound no kernel passes); the element-wise work (norms, rotary, residual adds, SiLU·mul where
  it is not in a GEMM's epilogue, their backward, gradient accumulation, the fp32 -> bf16 weight
  casts, AdamW) at its bytes / 4.28 TB/s; the fused log-prob head as measured (LOGPROB_S, a
  second per 275k tokens).
--kv-cache fp8 counts the KV cache at one byte an element; --fp8-gemms counts the layers' decode
GEMMs (not the head's) at one byte a weight and twice the matmul ceiling (the fp8 tensor cores'
rate, 1,536 TFLOP/s, not measured here), as rollout.quantization = "fp8" runs them. The byte
roofline stays the bf16 model's. The measured figures each floor is compared with are in
docs/benchmarks.md ("The step against its floors").
"""

from __future__ import annotations

import argparse

import torch

from minirl.models.loading import meta_model
from minirl.models.presets import preset_config
from minirl.observe.metrics import flops_params, train_flops

BANDWIDTH, MATMUL = 4.28e12, 768e12
ATTENTION_RATE = 170e12  # torch's FA2 varlen kernel: 0.15 s for 25 TFLOP in the ref pass, 0.45 s for 76 in the update
LOGPROB_S = {"forward": 0.03 / 275e3, "update": 0.11 / 275e3}  # fused log-prob kernels, s a token
BF16, FP32 = 2, 4


def shape(preset: str) -> dict:
    cfg = preset_config(preset)
    n = flops_params(meta_model(cfg, torch.float32, "sdpa"))
    d = cfg.hidden_size // cfg.num_attention_heads
    return dict(
        cfg=cfg, n=n, h=cfg.hidden_size, ff=cfg.intermediate_size, layers=cfg.num_hidden_layers, vocab=cfg.vocab_size,
        q=cfg.num_attention_heads * d, kv=cfg.num_key_value_heads * d,
    )  # fmt: skip


def gemm_s(rows: int, n: int, k: int, fp8: bool = False) -> float:
    return max(2 * rows * n * k / (MATMUL * (2 if fp8 else 1)), (1 if fp8 else BF16) * n * k / BANDWIDTH)


def decode_step_s(s: dict, rows: int, context: float) -> float:
    """One decode step at `rows` rows of mean `context` tokens, every kernel at its floor."""
    h, q, kv, ff, f8 = s["h"], s["q"], s["kv"], s["ff"], s["fp8_gemms"]
    layer = gemm_s(rows, q + 2 * kv, h, f8) + gemm_s(rows, h, q, f8) + gemm_s(rows, 2 * ff, h, f8)
    layer += gemm_s(rows, h, ff, f8)
    attention = rows * context * 2 * kv * s["kv_bytes"] / BANDWIDTH
    head = gemm_s(rows, s["vocab"], h) + rows * s["vocab"] * FP32 / BANDWIDTH  # + the sampler's read
    return s["layers"] * (layer + attention) + head


def generation_s(s: dict, rows: int, prompt: int, response: int) -> tuple[float, float]:
    """(floor, byte roofline): the decode steps and the prefill at their floors; the roofline the
    generation figures divide by (weights and live KV bytes a step at 4.28 TB/s)."""
    steps = [decode_step_s(s, rows, prompt + t) for t in range(response)]
    prefill = 2 * s["n"] * rows * prompt / MATMUL
    weights = BF16 * s["n"]
    kv_token = s["layers"] * 2 * s["kv"] * BF16
    roofline = sum((weights + rows * (prompt + t) * kv_token) / BANDWIDTH for t in range(response))
    return sum(steps) + prefill, roofline


def elementwise_bytes(s: dict, tokens: int, backward: bool, fused_mlp: bool) -> float:
    """Activation bytes the element-wise kernels move: two add + RMSNorms (read residual and x,
    write both: 4h), rotary on q and k (read, write), SiLU·mul (read gate and up, write: 3ff) unless
    a GEMM's epilogue does it; backward: the norms' and rotary's twice, SiLU·mul's five ff."""
    h, q, kv, ff = s["h"], s["q"], s["kv"], s["ff"]
    fwd = 2 * 4 * h + 2 * (q + kv) + (0 if fused_mlp else 3 * ff)
    bwd = 2 * (2 * 4 * h + 2 * (q + kv)) + 5 * ff if backward else 0
    return (fwd + bwd) * BF16 * s["layers"] * tokens


def weight_bytes_per_micro_batch(s: dict, backward: bool) -> float:
    """fp32 masters -> bf16 copies (read 4, write 2 a parameter) per gather, two gathers a
    micro-batch in the update (forward and backward); fp32 gradient accumulation (read, write)."""
    n = s["n"]
    cast = (FP32 + BF16) * n
    return cast * (2 if backward else 1) + (2 * FP32 * n if backward else 0)


def pass_s(s: dict, lens: list[int], budget: int, attention_rate: float, optimizer_steps: int = 0) -> dict[str, float]:
    """A log-prob pass (optimizer_steps 0) or the update over `lens`, kernel class by kernel class."""
    backward = optimizer_steps > 0
    tokens = sum(lens)
    micro = -(-tokens // budget)
    total = train_flops(s["cfg"], s["n"], lens, backward=backward)
    gemm_flops = (6 if backward else 2) * s["n"] * tokens
    out = {
        "GEMMs": gemm_flops / MATMUL,
        "attention": (total - gemm_flops) / attention_rate,
        "element-wise": (elementwise_bytes(s, tokens, backward, fused_mlp=not backward)
                         + micro * weight_bytes_per_micro_batch(s, backward)) / BANDWIDTH,
        "log-prob head": tokens * LOGPROB_S["update" if backward else "forward"],
    }  # fmt: skip
    if backward:
        out["AdamW"] = optimizer_steps * 7 * FP32 * s["n"] / BANDWIDTH  # read p, g, m, v; write p, m, v
    out["floor"] = sum(out.values())
    out["MFU at the floor"] = total / out["floor"] / 989e12 if backward else 0.0
    return out


def adapted(s: dict) -> list[tuple[int, int]]:
    """(in, out) of the matrices `all-linear` LoRA adapts in a layer: q, k, v, o, gate, up, down."""
    h, q, kv, ff = s["h"], s["q"], s["kv"], s["ff"]
    return [(h, q), (h, kv), (h, kv), (q, h), (h, ff), (h, ff), (ff, h)]


def lora_update_s(s: dict, lens: list[int], budget: int, attention_rate: float, rank: int, steps: int) -> dict:
    """The LoRA update with minirl's merged layer (minirl.models.lora.MergedLinear): the frozen
    matrices' forward and input-gradient GEMMs (4·N a token); the adapters' gradients, four skinny
    GEMMs a matrix (x Aᵀ, dy B, then dA and dB), each reading a [tokens, in] or [tokens, out]
    activation once, so bytes-bound at rank 64 (2·rank FLOPs per 2 bytes); the merge W + s·B A
    twice a micro-batch (forward and backward: read W, write the merged copy); the same
    activations' element-wise work, attention and log-prob head as full fine-tuning; no weight
    casts (the frozen base is held in bf16) and AdamW over the adapters alone."""
    tokens, micro = sum(lens), -(-sum(lens) // budget)
    full = pass_s(s, lens, budget, attention_rate, optimizer_steps=steps)
    mats = adapted(s)
    n_adapters = s["layers"] * sum(rank * (i + o) for i, o in mats)
    skinny = sum(2 * max(2 * rank * d / MATMUL, BF16 * d / BANDWIDTH) for i, o in mats for d in (i, o))
    merge = sum(max(2 * rank * i * o / MATMUL, 2 * BF16 * i * o / BANDWIDTH) for i, o in mats)
    out = {
        "GEMMs": 4 * s["n"] * tokens / MATMUL,
        "adapter gradients": s["layers"] * tokens * skinny,
        "merges": s["layers"] * 2 * micro * merge,
        "attention": full["attention"],
        "element-wise": (elementwise_bytes(s, tokens, True, False) + micro * 2 * FP32 * n_adapters) / BANDWIDTH,
        "log-prob head": full["log-prob head"],
        "AdamW": steps * 7 * FP32 * n_adapters / BANDWIDTH,
    }  # fmt: skip
    out["floor"] = sum(out.values())
    out["ratio"] = out["floor"] / full["floor"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen2-1.5b")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=50, help="mean prompt tokens (275k tokens a step)")
    ap.add_argument("--response-len", type=int, default=1024)
    ap.add_argument("--mini-batches", type=int, default=1, help="optimizer steps a step")
    ap.add_argument("--prev-pass", action="store_true", help="count a prev-log-prob pass (off-policy mini-batches)")
    ap.add_argument("--budget", type=int, default=30000, help="tokens a micro-batch")
    ap.add_argument("--attention-rate", type=float, default=ATTENTION_RATE / 1e12, help="TFLOP/s")
    ap.add_argument("--lora-rank", type=int, default=0, help="also the LoRA update's floor (all-linear)")
    ap.add_argument("--kv-cache", choices=("bf16", "fp8"), default="bf16", help="rollout.kv_cache_dtype")
    ap.add_argument("--fp8-gemms", action="store_true", help="rollout.quantization = fp8")
    args = ap.parse_args()
    s = shape(args.preset)
    s.update(kv_bytes=1 if args.kv_cache == "fp8" else BF16, fp8_gemms=args.fp8_gemms)
    rows = args.prompts * args.n
    lens = [args.prompt_len + args.response_len] * rows
    rate = args.attention_rate * 1e12
    gen, roof = generation_s(s, rows, args.prompt_len, args.response_len)
    fwd = pass_s(s, lens, args.budget, rate)
    upd = pass_s(s, lens, args.budget, rate, optimizer_steps=args.mini_batches)
    print(f"{args.preset}: {rows} sequences of {lens[0]} tokens ({sum(lens):,} a step), N = {s['n'] / 1e9:.3f}B")
    print(f"generation floor {gen:.3f} s; byte roofline {roof:.3f} s (at the floor: {roof / gen:.1%} of the roofline)")
    for name, d in (("log-prob pass", fwd), ("update", upd)):
        parts = ", ".join(f"{k} {v:.3f}" for k, v in d.items() if k not in ("floor", "MFU at the floor"))
        mfu = f", MFU {d['MFU at the floor']:.1%}" if d["MFU at the floor"] else ""
        print(f"{name} floor {d['floor']:.3f} s ({parts}{mfu})")
    if args.lora_rank:
        lo = lora_update_s(s, lens, args.budget, rate, args.lora_rank, args.mini_batches)
        parts = ", ".join(f"{k} {v:.3f}" for k, v in lo.items() if k not in ("floor", "ratio"))
        print(f"LoRA r{args.lora_rank} update floor {lo['floor']:.3f} s ({parts}): {lo['ratio']:.3f} of full's")
    passes = 2 if args.prev_pass else 1
    step = gen + passes * fwd["floor"] + upd["floor"]
    print(f"step floor {step:.2f} s (generation, {passes} log-prob passes, update)")


if __name__ == "__main__":
    main()
