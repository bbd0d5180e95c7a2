"""Time the native engine's decode GEMM path of one Qwen2-1.5B layer, bf16 against fp8 (rollout.quantization).

    python3 dev/bench_fp8_decode.py --batches 64,256      # on a CUDA machine (an H200 or H100)

Per decode batch M, in a CUDA graph (triton.testing.do_bench_cudagraph): torch._scaled_mm alone
per matrix against bf16, and a layer's path outside attention and rotary as the engine runs it:
the input norm, qkv, o over a stand-in for the attention output (with the fp8 path's
quantize_rows), the residual norm, gate/up, SiLU·mul, down (rotary applies the qkv GEMM's row
scales in the fp8 path). What the fp8 path saves is the GEMMs' time less what its extra small
kernel costs. `--ops` also times each small kernel of the fp8 path alone, rope_store with and
without the qkv row scales and bias, and the four GEMMs chained without the small kernels (what
those and their launches add to the path).
"""

from __future__ import annotations

import argparse
import functools

import torch


def build(quantization: str):
    from minirl.models.presets import preset_config
    from minirl_plugins.engines.native.layers.ops import select_ops
    from minirl_plugins.engines.native.models.decoder import DecoderLM
    from minirl_plugins.engines.native.models.spec import ModelSpec
    from minirl_plugins.engines.native.weights import init_random

    config = preset_config("qwen2-1.5b")
    config.num_hidden_layers = 1
    spec = ModelSpec.from_hf_config(config)
    ops = select_ops(torch.device("cuda"), torch.bfloat16, quantization=quantization)
    with torch.device("cuda"):
        model = DecoderLM(spec, ops, torch.bfloat16).eval()
        if quantization == "fp8":
            model.quantize_fp8()
    init_random(model, 0.02, 0)
    model.refresh_fp8()
    return model, ops


def gemm_path(layer, ops, x, residual, attn_out, fp8: bool):
    """The layer's work outside attention and rotary, as DecoderLayer and its parts run it."""
    attn, eps = layer.self_attn, 1e-6
    if not fp8:
        h, residual = ops.add_rmsnorm(x, residual, layer.input_layernorm.weight, eps)
        qkv = torch.nn.functional.linear(h, attn.qkv_weight, attn.qkv_bias)
        o = torch.nn.functional.linear(attn_out, attn.o_proj.weight)
        h, residual = ops.add_rmsnorm(o, residual, layer.post_attention_layernorm.weight, eps)
        return layer.mlp(h), qkv
    (hq, hs), residual = ops.rmsnorm_rows(x, layer.input_layernorm.weight, eps, residual, None, True)
    qkv = attn.qkv_fp8.matmul(hq, ops, torch.bfloat16)
    oq, os_ = ops.quantize_rows(attn_out)
    o = attn.o_fp8.matmul(oq, ops, torch.bfloat16)
    (hq, hs), residual = ops.rmsnorm_rows(o, layer.post_attention_layernorm.weight, eps, residual, os_, True)
    return layer.mlp.forward_fp8(hq, hs), qkv


def small_ops(layer, ops, m, bench):
    """(name, µs) of each small kernel of the fp8 path at m rows, and the four GEMMs chained."""
    attn, mlp, eps, bf = layer.self_attn, layer.mlp, 1e-6, torch.bfloat16
    x, r, a = (torch.randn(m, 1536, device="cuda", dtype=bf) for _ in range(3))
    s = torch.rand(m, 1, device="cuda") + 0.5
    qkv = torch.randn(m, 2048, device="cuda", dtype=bf)
    gu = torch.randn(m, 2 * 8960, device="cuda", dtype=bf)
    hq, _ = ops.quantize_rows(x)
    pos = torch.arange(m, device="cuda") + 1000
    cos, sin = (torch.rand(4096, 64, device="cuda") for _ in range(2))
    slots = torch.randperm(4 * m, device="cuda")[:m]
    k_cache, v_cache = (torch.zeros(4 * m, 2, 128, device="cuda", dtype=torch.float8_e4m3fn) for _ in range(2))
    heads = attn.spec.heads
    mq, _ = ops.quantize_rows(torch.randn(m, 8960, device="cuda", dtype=bf))

    def gemms():
        attn.qkv_fp8.matmul(hq, ops, bf)
        attn.o_fp8.matmul(hq, ops, bf)
        mlp.gate_up_fp8.matmul(hq, ops, bf)
        mlp.down_fp8.matmul(mq, ops, bf)

    timed = {
        "rmsnorm_rows (residual, scales, e4m3 out)": lambda: ops.rmsnorm_rows(
            x, layer.input_layernorm.weight, eps, r, s, True
        ),
        "rope_store (fp8 cache)": lambda: ops.rope_store(qkv, pos, cos, sin, slots, k_cache, v_cache, heads),
        "rope_store with the qkv row scales and bias": lambda: ops.rope_store(
            qkv, pos, cos, sin, slots, k_cache, v_cache, heads, None, None, eps, (s, attn.qkv_bias)
        ),
        "quantize_rows (attention output)": lambda: ops.quantize_rows(a),
        "silu_mul_rows": lambda: ops.silu_mul_rows(gu, s),
        "four GEMMs chained": gemms,
    }
    return [(name, bench(fn) * 1e3) for name, fn in timed.items()]


def main() -> int:
    import triton.testing

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="64,256")
    p.add_argument("--ops", action="store_true", help="also each small kernel of the fp8 path alone")
    args = p.parse_args()
    bench = triton.testing.do_bench_cudagraph
    models = {q: build(q) for q in ("none", "fp8")}
    _, fp8_ops = models["fp8"]
    print(f"fp8 ops: {fp8_ops.chosen}")
    print("| M | what | bf16 us | fp8 us |")
    print("| ---: | --- | ---: | ---: |")
    for m in (int(b) for b in args.batches.split(",")):
        layer = models["fp8"][0].model.layers[0]
        for name, fp8, weight in (
            ("qkv", layer.self_attn.qkv_fp8, layer.self_attn.qkv_weight),
            ("o", layer.self_attn.o_fp8, layer.self_attn.o_proj.weight),
            ("gate_up", layer.mlp.gate_up_fp8, layer.mlp.gate_up_weight),
            ("down", layer.mlp.down_fp8, layer.mlp.down_proj.weight),
        ):
            x = torch.randn(m, weight.shape[1], device="cuda", dtype=torch.bfloat16)
            q, _ = fp8_ops.quantize_rows(x)
            bf16 = bench(lambda x=x, w=weight: torch.nn.functional.linear(x, w)) * 1e3
            f8 = bench(lambda q=q, f=fp8: f.matmul(q, fp8_ops, torch.bfloat16)) * 1e3
            print(f"| {m} | GEMM {name} | {bf16:.1f} | {f8:.1f} |", flush=True)
        times = []
        for q in ("none", "fp8"):
            model, ops = models[q]
            x, r, a = (torch.randn(m, 1536, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            layer = model.model.layers[0]
            run = functools.partial(gemm_path, layer, ops, x, r, a, q == "fp8")
            times.append(bench(run) * 1e3)
        print(f"| {m} | layer's GEMM path | {times[0]:.1f} | {times[1]:.1f} |", flush=True)
        if args.ops:
            for name, us in small_ops(models["fp8"][0].model.layers[0], fp8_ops, m, bench):
                print(f"| {m} | {name} | | {us:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
