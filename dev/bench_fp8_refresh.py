"""The weight sync's re-quantization with rollout.quantization = "fp8", per full sync, on CUDA.

    python3 dev/bench_fp8_refresh.py [--preset qwen2-1.5b]

After every load the engine rewrites each layer's qkv, o, gate/up and down e4m3 copy from the bf16
weight (fp8_linear.Fp8Weight.refresh). Times one pass over all of them with the torch reference
(quantize_into: abs, amax, float32 copy, multiply, clamp, cast, copy) and with the kernel the
engine selects (quantize_into_triton: one inf-norm reduction, one fused scale-round-store), and
each against the copy-bandwidth floor of a two-pass quantizer's 5 bytes an element (read bf16 for
the amax, read it again and write e4m3), measured here as a bf16 -> bf16 copy of the same weights
(4 bytes an element) scaled by 5/4.
"""

from __future__ import annotations

import argparse

import torch
from cuda_timing import cuda_ms

from minirl.models.presets import preset_config
from minirl_plugins.engines.native.layers import fp8_linear as f


def shapes(preset: str) -> list[tuple[int, int]]:
    """(out, in) of the four quantized matrices of a layer (fused qkv and gate/up), per layer."""
    c = preset_config(preset)
    h, i = c.hidden_size, c.intermediate_size
    kv = c.num_key_value_heads * (h // c.num_attention_heads)
    return [(h + 2 * kv, h), (h, h), (2 * i, h), (h, i)] * c.num_hidden_layers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2-1.5b")
    args = ap.parse_args()
    dev = torch.device("cuda")
    weights = [f.Fp8Weight(torch.randn(s, device=dev, dtype=torch.bfloat16) * 0.02) for s in shapes(args.preset)]
    scratch = [torch.empty_like(w.source) for w in weights]
    elements = sum(w.source.numel() for w in weights)

    def refresh(quantizer):
        def run():
            for w in weights:
                quantizer(w.source, w.q, w.scale)

        return run

    def copy():
        for w, s in zip(weights, scratch):
            s.copy_(w.source)

    refresh(f.quantize_into_triton)()
    kernel = [(w.q.clone(), w.scale.clone()) for w in weights]
    refresh(f.quantize_into)()
    differ = sum(int((w.q.view(torch.uint8) != q.view(torch.uint8)).sum()) for w, (q, _) in zip(weights, kernel))
    scales = sum(int(not torch.equal(w.scale, s)) for w, (_, s) in zip(weights, kernel))
    copy_ms = cuda_ms(copy)
    floor_ms = copy_ms * 5 / 4  # 5 bytes an element against the copy's 4
    print(f"{len(weights)} matrices, {elements / 1e9:.3f}G elements; the kernel against the reference:")
    print(f"{differ} e4m3 values and {scales} scales differ")
    print(f"copy-bandwidth floor (5 B/element): {floor_ms:.2f} ms ({4 * elements / copy_ms / 1e6:.0f} GB/s copy)")
    print("| quantizer | ms per sync | of the floor |")
    print("| --- | ---: | ---: |")
    for name, fn in (("torch reference", f.quantize_into), ("triton", f.quantize_into_triton)):
        ms = cuda_ms(refresh(fn))
        print(f"| {name} | {ms:.2f} | {floor_ms / ms:.0%} |")


if __name__ == "__main__":
    main()
