"""The rollout's log-prob drift at the Qwen2-1.5B shape, per KV cache format and GEMM precision.

    python3 dev/check_rollout_drift.py                       # on a CUDA machine
    python3 dev/check_rollout_drift.py --prompts 64 --new 256 --variants auto:none,fp8:none,fp8:fp8
    python3 dev/check_rollout_drift.py --device cpu --shape tiny --prompts 4 --new 16     # a CPU smoke run

Random weights (the preset's initializer range), as the benchmarks' runs use. For each variant
(rollout.kv_cache_dtype : rollout.quantization), the native engine samples `--new` tokens at
temperature 1 for `--prompts` prompts of 100 random tokens, and transformers' bf16 forward (the
trainer's model, sdpa) recomputes each sampled token's log-prob: the figures the trainer logs as
rollout_corr/* on step 1: the mean of lp_train − lp_rollout (log_ratio_mean), the mean |·|, and
the mean and largest |p_train − p_rollout|.
"""

from __future__ import annotations

import argparse

import torch


def build(kv: str, quantization: str, hf, config, device):
    from minirl.config.schema import RolloutConfig
    from minirl.protocols import EngineContext
    from minirl_plugins.engines.native import build_native_engine

    rollout = RolloutConfig(kv_cache_dtype=kv, quantization=quantization, gpu_memory_utilization=0.3)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ctx = EngineContext(config, hf, device, dtype, (), 0, extra={"max_model_len": 1024})
    return build_native_engine(rollout, ctx)


@torch.no_grad()
def recompute(hf, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens], device=hf.device)
    logits = hf(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None])[:, 0]


def main() -> int:
    from transformers import Qwen2ForCausalLM

    from minirl.models.presets import preset_config
    from minirl.protocols import SamplingParams

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--variants", default="auto:none,fp8:none,auto:fp8,fp8:fp8")
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default="qwen2-1.5b")
    args = p.parse_args()
    device = torch.device(args.device)
    config = preset_config(args.shape)
    torch.manual_seed(0)
    with device:
        hf = Qwen2ForCausalLM(config).to(torch.bfloat16 if device.type == "cuda" else torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, config.vocab_size, (100,), generator=gen).tolist() for _ in range(args.prompts)]
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new, ignore_eos=True, seed=3)
    print("| kv_cache_dtype | quantization | log_ratio_mean | mean abs log ratio | prob_diff_mean | prob_diff_max |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for variant in args.variants.split(","):
        kv, quantization = variant.split(":")
        engine = build(kv, quantization, hf, config, device)
        ratios, diffs = [], []
        for prompt, c in zip(prompts, engine.generate(prompts, params)):
            train = recompute(hf, prompt, c.token_ids)
            roll = torch.tensor(c.logprobs, device=device)
            ratios.append(train - roll)
            diffs.append((train.exp() - roll.exp()).abs())
        r, d = torch.cat(ratios), torch.cat(diffs)
        print(
            f"| {kv} | {quantization} | {r.mean():.5f} | {r.abs().mean():.5f} | {d.mean():.2e} | {d.max():.2e} |",
            flush=True,
        )
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
