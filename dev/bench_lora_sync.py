"""Merge the LoRA adapters at each sync, or apply them in the engine's GEMMs? Times both on CUDA.

    python3 dev/bench_lora_sync.py [--preset qwen2-1.5b] [--rank 64] [--rows 256] [--steps 1024]

At the preset's shape with every linear layer targeted (`all-linear`), in bf16:
1. merge: what the weight sync does per targeted matrix (minirl.adapter, `engine_weights`),
   W + B A * alpha / r summed in float32 and rounded once (minirl.models.lora.merged), then the
   copy into the engine's weight;
2. apply: the two extra GEMMs a decode step would run per targeted matrix, (x Aᵀ) Bᵀ for `rows`
   sequences, beside the base GEMM x Wᵀ (timed as the difference), times `steps` decode steps
   of one rollout.
Prints both per sync / per rollout, so the cheaper design at that shape is read off directly.
"""

from __future__ import annotations

import argparse

import torch
from cuda_timing import cuda_ms

from minirl.models.presets import preset_config


def shapes(preset: str) -> list[tuple[int, int]]:
    """(out, in) of every targeted matrix of one decoder layer, times the number of layers."""
    c = preset_config(preset)
    h, i = c.hidden_size, c.intermediate_size
    kv = c.num_key_value_heads * (h // c.num_attention_heads)
    layer = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]  # q k v o gate up down
    return layer * c.num_hidden_layers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2-1.5b")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--rows", type=int, default=256, help="sequences per decode step")
    ap.add_argument("--steps", type=int, default=1024, help="decode steps per rollout")
    args = ap.parse_args()
    dev, r = torch.device("cuda"), args.rank
    mats = []
    for out_f, in_f in shapes(args.preset):
        w = torch.randn(out_f, in_f, device=dev, dtype=torch.bfloat16) * 0.02
        a = torch.randn(r, in_f, device=dev) * 0.02
        b = torch.randn(out_f, r, device=dev) * 0.02
        mats.append((w, a, b, torch.empty_like(w)))

    def merge_all():
        for w, a, b, engine_w in mats:
            engine_w.copy_((w.float() + (b @ a) * 1.0).to(w.dtype))

    x_by_in = {in_f: torch.randn(args.rows, in_f, device=dev, dtype=torch.bfloat16) for _, in_f in shapes(args.preset)}
    lowp = [(w, a.to(w.dtype), b.to(w.dtype)) for w, a, b, _ in mats]

    def base_step():
        for w, _, _ in lowp:
            x_by_in[w.shape[1]] @ w.T

    def lora_step():
        for w, a, b in lowp:
            x = x_by_in[w.shape[1]]
            x @ w.T + (x @ a.T) @ b.T

    merge = cuda_ms(merge_all)
    base, with_lora = cuda_ms(base_step), cuda_ms(lora_step)
    extra = (with_lora - base) * args.steps
    print(f"{args.preset}, rank {r}, {len(mats)} targeted matrices, {args.rows} rows x {args.steps} decode steps")
    print(f"merge at each sync:          {merge:8.2f} ms")
    print(f"decode GEMMs, base:          {base:8.3f} ms/step; with adapters applied {with_lora:.3f} ms/step")
    print(f"adapters applied in GEMMs:   {extra:8.2f} ms per rollout ({with_lora - base:.3f} ms x {args.steps} steps)")
    print(f"cheaper: {'merge' if merge < extra else 'apply in GEMMs'}")


if __name__ == "__main__":
    main()
