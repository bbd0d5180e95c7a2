"""Times two decoder-layer fusions (SiLU·mul in the gate/up GEMM, residual add in addmm) on CUDA.

Would fewer bytes in the decoder layer pay? Times, at a packed micro-batch's M, each fusion that
minirl's own decoder layer could make against what the compiled Hugging Face layer runs now.

    python3 dev/bench_mlp.py [--residual]       # on the H200: M = 28,000 (a ref-pass micro-batch)
    python3 dev/bench_mlp.py --decode 64,256    # the native engine's decode MLP at those batch rows

(The kernel's values on the CPU, under Triton's interpreter: tests/unit/test_fused_mlp.py.)

1. SiLU·mul in the gate/up GEMM's epilogue. Now: cuBLAS gate GEMM, cuBLAS up GEMM (each writes
   M×I bf16), then one fused element-wise kernel that reads both and writes silu(g)·u. Fused: a
   Triton GEMM whose program multiplies one row tile of x by the same column tile of W_gate and
   W_up (two accumulators sharing the x tile) and writes silu(g)·u only. Its epilogue rounds as
   eager does (g and u to bf16, silu in float32 to bf16, the product to bf16), so it can differ
   from the unfused bits only where the two GEMMs' float32 sums round differently.
   minirl's kernel (minirl/kernels/fused_mlp.py), swept over its tiling.
2. The residual add in the projection's epilogue. Now: cuBLAS o_proj / down_proj writes y, then
   one fused kernel reads y and the residual r and writes h = r + y and rmsnorm(h). Fused:
   cuBLAS addmm (β = 1) writes h = r + x Wᵀ, then a norm kernel reads h and writes rmsnorm(h).
Prints each variant's time, its TFLOP/s, and its agreement with the unfused bits.

--decode: fusion 1 at a decode step's M (the batch rows), against what the native engine runs
there (one cuBLAS GEMM over the concatenated gate/up weight, then its Triton SiLU·mul kernel),
each replayed from a CUDA graph as the engine's decode step is, with tilings for a small M.
Floor: max(weight bytes / 4.28 TB/s, FLOPs / 768 TFLOP/s).
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
from cuda_timing import cuda_ms
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from minirl.kernels.fused_mlp import launch
from minirl.models import fused_mlp
from minirl.models.compile import INDUCTOR_OPTIONS

HIDDEN, INTER = 1536, 8960


def gate_up_silu(
    x,
    wg,
    wu,
    bm=fused_mlp.BLOCK_M,
    bn=fused_mlp.BLOCK_N,
    bk=fused_mlp.BLOCK_K,
    group_m=fused_mlp.GROUP_M,
    warps=fused_mlp.WARPS,
    stages=fused_mlp.STAGES,
):
    """minirl's kernel with its tiling (the defaults) or another one."""
    return launch(x, wg, wu, bm, bn, bk, group_m, warps, stages)


def silu_mul_eager(g, u):
    return torch.nn.functional.silu(g) * u


def add_norm(y, r, norm):
    h = r + y
    return h, norm(h)


def agreement(a, b) -> str:
    differ = int((a != b).sum())
    rel = ((a.float() - b.float()).abs() / b.float().abs().clamp_min(1e-2)).max().item()
    return f"{differ} of {a.numel()} values differ, max relative diff {rel:.3g}"


def configs():
    """Around the first sweep's best (128 × 128 × 64, 8 warps, 3 stages, TMA; pointer loads were
    no faster; a 128-wide K block needs more shared memory than the H200 has): stages and group."""
    for (bm, bn, bk), warps, stages, group_m in itertools.product(((128, 128, 64),), (8,), (3, 4), (8, 16, 32)):
        yield dict(bm=bm, bn=bn, bk=bk, warps=warps, stages=stages, group_m=group_m)


def bench_gate_up(m: int):
    torch.manual_seed(0)
    x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
    wg = torch.randn(INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) * HIDDEN**-0.5
    wu = torch.randn(INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) * HIDDEN**-0.5
    flops = 2 * 2 * m * INTER * HIDDEN
    fused = torch.compile(silu_mul_eager, options=INDUCTOR_OPTIONS)
    ref = silu_mul_eager(x @ wg.T, x @ wu.T)
    base_ms = cuda_ms(lambda: fused(x @ wg.T, x @ wu.T), reps=20)
    gemm_ms = cuda_ms(lambda: (x @ wg.T, x @ wu.T), reps=20)
    print(
        f"gate/up M={m}: cuBLAS GEMMs {gemm_ms:.3f} ms ({flops / gemm_ms / 1e9:.0f} TFLOP/s) "
        f"+ silu·mul = {base_ms:.3f} ms; compiled vs eager: {agreement(fused(x @ wg.T, x @ wu.T), ref)}"
    )
    rows = []
    for cfg in configs():
        run = functools.partial(gate_up_silu, x, wg, wu, **cfg)
        try:
            rows.append((cuda_ms(run, reps=20), cfg, agreement(run(), ref)))
        except Exception as exc:  # a tile that does not fit shared memory, or no TMA
            print(cfg, "failed:", type(exc).__name__, str(exc).splitlines()[0][:100])
    rows.sort(key=lambda r: r[0])
    for ms, cfg, agree in rows[:8]:
        print(f"  {ms:.3f} ms {flops / ms / 1e9:5.0f} TFLOP/s  {ms / base_ms:.1%} of now  {cfg}  {agree}")


def bench_residual(m: int):
    dev = "cuda"
    torch.manual_seed(0)
    rms_norm = Qwen2RMSNorm(HIDDEN).to(dev, torch.bfloat16)
    r = torch.randn(m, HIDDEN, device=dev, dtype=torch.bfloat16)
    norm = torch.compile(rms_norm, options=INDUCTOR_OPTIONS)
    addn = torch.compile(functools.partial(add_norm, norm=rms_norm), options=INDUCTOR_OPTIONS)
    for name, k in (("o_proj", HIDDEN), ("down", INTER)):
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        wt = (torch.randn(HIDDEN, k, device=dev, dtype=torch.bfloat16) * k**-0.5).T
        now = cuda_ms(functools.partial(lambda a, wt: addn(a @ wt, r), a, wt), reps=20)
        fused = cuda_ms(functools.partial(lambda a, wt: norm(torch.addmm(r, a, wt)), a, wt), reps=20)
        mm = cuda_ms(functools.partial(torch.mm, a, wt), reps=20)
        addmm = cuda_ms(functools.partial(torch.addmm, r, a, wt), reps=20)
        h_now, h_fused = addn(a @ wt, r)[0], torch.addmm(r, a, wt)
        print(
            f"{name} M={m}: mm + add·norm {now:.3f} ms (mm {mm:.3f}); addmm + norm {fused:.3f} ms "
            f"(addmm {addmm:.3f}): {fused / now:.1%}; h: {agreement(h_fused, h_now)}"
        )


def decode_configs():
    for bm, bn, bk, warps, stages in itertools.product((64, 128), (64, 128), (64, 128), (4, 8), (3, 4)):
        yield dict(bm=bm, bn=bn, bk=bk, warps=warps, stages=stages, group_m=8)


def bench_decode(rows: list[int]):
    import triton.testing

    from minirl_plugins.engines.native.layers.ops import select_ops

    ops = select_ops(torch.device("cuda"), torch.bfloat16)
    w = torch.randn(2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) * HIDDEN**-0.5
    wg, wu = w[:INTER], w[INTER:]
    for m in rows:
        x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
        floor = max(w.numel() * 2 / 4.28e12, 2 * m * w.numel() / 768e12) * 1e6
        engine = functools.partial(lambda x: ops.silu_mul(torch.nn.functional.linear(x, w)), x)
        ref = engine()
        now = triton.testing.do_bench_cudagraph(engine) * 1e3
        print(f"decode MLP gate/up M={m}: engine (cuBLAS + silu_mul) {now:.1f} us, floor {floor:.1f} us")
        found = []
        for cfg in decode_configs():
            run = functools.partial(gate_up_silu, x, wg, wu, **cfg)
            try:
                found.append((triton.testing.do_bench_cudagraph(run) * 1e3, cfg, agreement(run(), ref)))
            except Exception as exc:  # shared memory, or a tile larger than the problem
                print(" ", cfg, "failed:", type(exc).__name__, str(exc).splitlines()[0][:80])
        for us, cfg, agree in sorted(found, key=lambda r: r[0])[:6]:
            print(f"  {us:.1f} us ({now / us:.2f}x the engine's; floor {floor / us:.0%})  {cfg}  {agree}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=28000)
    p.add_argument("--residual", action="store_true", help="also time the residual add in addmm")
    p.add_argument("--decode", default="", help="decode batch rows, e.g. 64,256: the engine's decode MLP instead")
    args = p.parse_args()
    if args.decode:
        bench_decode([int(r) for r in args.decode.split(",")])
        return
    bench_gate_up(args.m)
    if args.residual:
        bench_residual(args.m)


if __name__ == "__main__":
    main()
