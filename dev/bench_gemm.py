"""Time the decode step's GEMMs (bf16, y = x W^T) per cuBLAS back end, against their floors.

    python3 dev/bench_gemm.py                                   # the default back end, both libraries
    CUBLASLT_WORKSPACE_SIZE=65536 python3 dev/bench_gemm.py     # a larger cuBLASLt workspace (KiB)

    python3 dev/bench_gemm.py --split-k down --batches 256,512  # split-K candidates for one GEMM
    python3 dev/bench_gemm.py --shapes hf --batches 27500       # the log-prob pass's GEMMs
    python3 dev/bench_gemm.py --inductor --batches 64,256       # inductor's max-autotune against cuBLAS
    python3 dev/bench_gemm.py --fp8 --batches 64,256            # fp8 weights and activations (rollout)

Floor of each: max(weight bytes / 4.28 TB/s, FLOPs / 768 TFLOP/s), the H200's measured copy
bandwidth and bf16 matmul ceiling. Shapes: the Qwen2-1.5B layer at decode batch M.

--inductor compiles each GEMM with inductor's max-autotune (its Triton templates, the persistent
TMA one included, against cuBLAS; inductor prints each shape's AUTOTUNE table) and times the
winner against cuBLAS: whether any kernel inductor can generate beats cuBLAS at the decode's M.

--split-k times two split-K candidates against cuBLAS and checks each against it: a Triton
kernel (each program multiplies one output tile over one K slice into float32 partials, summed
by torch) swept over tiles and splits, and cuBLAS's batched GEMM over K slices with float32
outputs (torch.bmm(..., out_dtype=float32) where this torch has it).

--fp8 times torch._scaled_mm over e4m3 weights and activations (one scale per weight row and
one per activation row, or one per tensor) against the bf16 GEMM, with the cost of quantizing
the activations (a compiled amax-and-cast) and each result's error against the bf16 GEMM. Its
floor is the fp8 weight bytes or the FLOPs at twice the bf16 ceiling.
"""

from __future__ import annotations

import argparse
import os

import torch
import triton
import triton.language as tl

BANDWIDTH, MATMUL = 4.28e12, 768e12
SHAPES = {
    "qkv": (2048, 1536),
    "o_proj": (1536, 1536),
    "gate_up": (17920, 1536),
    "down": (1536, 8960),
    "lm_head": (151936, 1536),
}
# The same layer as Hugging Face's Qwen2 runs it in the training and log-prob passes: separate
# projections (k and v alike), at a packed micro-batch's M (--shapes hf --batches 27500).
HF_SHAPES = {
    "q / o_proj": (1536, 1536),
    "k / v_proj": (256, 1536),
    "gate / up_proj": (8960, 1536),
    "down": SHAPES["down"],
    "lm_head": SHAPES["lm_head"],
}


@triton.jit
def _split_k_kernel(x_ptr, w_ptr, part_ptr, M, N, K, K_SLICE, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """part[s] = x[:, slice s] @ w[:, slice s]^T for one (BM x BN) tile; K_SLICE divides K and BK."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    start = tl.program_id(2) * K_SLICE
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K_SLICE, BK):
        ks = start + k + tl.arange(0, BK)
        a = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=rows[:, None] < M, other=0.0)
        b = tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=cols[:, None] < N, other=0.0)
        acc += tl.dot(a, tl.trans(b))
    out = part_ptr + tl.program_id(2) * M * N + rows[:, None] * N + cols[None, :]
    tl.store(out, acc, mask=(rows[:, None] < M) & (cols[None, :] < N))


def split_k_triton(x, w, splits: int, bm: int, bn: int, bk: int, warps: int, stages: int):
    m, k = x.shape
    n = w.shape[0]
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), splits)
    _split_k_kernel[grid](x, w, part, m, n, k, k // splits, BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages)
    return part.sum(0).to(x.dtype)


def split_k_bmm(x, w, splits: int):
    m, k = x.shape
    xs = x.view(m, splits, k // splits).transpose(0, 1)
    ws = w.view(w.shape[0], splits, k // splits).permute(1, 2, 0)
    return torch.bmm(xs, ws, out_dtype=torch.float32).sum(0).to(x.dtype)


def split_k_table(name: str, batches: list[int]) -> None:
    import triton.testing

    n, k = SHAPES[name]
    print(f"\n{name} ({n} x {k}): split-K candidates, µs (error: max |candidate - cuBLAS| / max |cuBLAS|)")
    print("| M | candidate | us | floor us | error |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for m in batches:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        want = torch.nn.functional.linear(x, w)
        floor = max(n * k * 2 / BANDWIDTH, 2 * m * n * k / MATMUL) * 1e6
        rows = [("cuBLAS", lambda x=x, w=w: torch.nn.functional.linear(x, w))]
        for splits in (2, 4, 5, 7):
            if k % (splits * 64):
                continue
            rows.append((f"bmm split {splits}", lambda x=x, w=w, s=splits: split_k_bmm(x, w, s)))
            for bm, bn, bk, warps, stages in (
                (64, 64, 64, 4, 4),
                (64, 128, 64, 4, 4),
                (128, 128, 64, 8, 3),
                (64, 128, 128, 8, 3),
            ):
                if (k // splits) % bk:
                    continue
                cfg = (splits, bm, bn, bk, warps, stages)
                rows.append((f"triton {cfg}", lambda x=x, w=w, c=cfg: split_k_triton(x, w, *c)))
        best = None
        for label, fn in rows:
            try:
                err = float((fn() - want).abs().max() / want.abs().max())
                us = triton.testing.do_bench_cudagraph(fn) * 1e3
            except Exception as exc:  # a config out of resources, or bmm without out_dtype
                print(f"| {m} | {label} | failed: {type(exc).__name__}: {str(exc)[:60]} | | |")
                continue
            best = min(best or (us, label), (us, label))
            print(f"| {m} | {label} | {us:.1f} | {floor:.1f} | {err:.1e} |", flush=True)
        print(f"| {m} | **best: {best[1]}** | **{best[0]:.1f}** | {floor:.1f} | |")


def inductor_table(batches: list[int]) -> None:
    """cuBLAS against the best of inductor's max-autotune choices, per decode GEMM and M."""
    import triton.testing
    from torch._inductor import config as inductor_config

    inductor_config.max_autotune_gemm_backends = "ATEN,TRITON"
    inductor_config.triton.enable_persistent_tma_matmul = True
    print("| M | GEMM | cuBLAS us | inductor us | floor us | inductor / cuBLAS | error |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for m in batches:
        for name, (n, k) in SHAPES.items():
            x, w = operands(m, n, k)
            floor = max(n * k * 2 / BANDWIDTH, 2 * m * n * k / MATMUL) * 1e6
            torch._dynamo.reset()
            tuned = torch.compile(
                lambda x, w: torch.nn.functional.linear(x, w), mode="max-autotune-no-cudagraphs", dynamic=False
            )
            want = torch.nn.functional.linear(x, w)
            err = float((tuned(x, w) - want).abs().max() / want.abs().max())
            cublas = triton.testing.do_bench_cudagraph(lambda x=x, w=w: torch.nn.functional.linear(x, w)) * 1e3
            best = triton.testing.do_bench_cudagraph(lambda x=x, w=w, f=tuned: f(x, w)) * 1e3
            print(
                f"| {m} | {name} | {cublas:.1f} | {best:.1f} | {floor:.1f} | {best / cublas:.2f} | {err:.1e} |",
                flush=True,
            )


def operands(m: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode batch x [m, k] and a weight w [n, k] of the Qwen2 init's scale, bf16 on CUDA."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    return x, torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02


def fp8_table(batches: list[int]) -> None:
    """bf16 cuBLAS against torch._scaled_mm (row-wise and per-tensor scales) per decode GEMM."""
    import triton.testing

    from minirl_plugins.engines.native.layers.fp8_linear import quantize_rows

    quant = torch.compile(quantize_rows, dynamic=False)
    print("| M | GEMM | bf16 us | fp8 rows us | fp8 tensor us | quant us | fp8 floor us | rows / bf16 | error |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for m in batches:
        for name, (n, k) in SHAPES.items():
            x, w = operands(m, n, k)
            wq, ws = quantize_rows(w)
            xq, xs = quant(x)
            floor = max(n * k / BANDWIDTH, 2 * m * n * k / (2 * MATMUL)) * 1e6
            want = torch.nn.functional.linear(x, w)

            def rows(xq=xq, xs=xs, wq=wq, ws=ws):
                return torch._scaled_mm(xq, wq.t(), xs, ws.t(), out_dtype=torch.bfloat16)

            one_a, one_b = xs.max().reshape(()), ws.max().reshape(())

            def tensor(xq=xq, wq=wq, a=one_a, b=one_b):
                return torch._scaled_mm(xq, wq.t(), a, b, out_dtype=torch.bfloat16)

            err = float((rows() - want).abs().max() / want.abs().max())
            bf16 = triton.testing.do_bench_cudagraph(lambda x=x, w=w: torch.nn.functional.linear(x, w)) * 1e3
            us_rows = triton.testing.do_bench_cudagraph(rows) * 1e3
            us_tensor = triton.testing.do_bench_cudagraph(tensor) * 1e3
            us_quant = triton.testing.do_bench_cudagraph(lambda x=x: quant(x)) * 1e3
            print(
                f"| {m} | {name} | {bf16:.1f} | {us_rows:.1f} | {us_tensor:.1f} | {us_quant:.1f} | {floor:.1f} "
                f"| {us_rows / bf16:.2f} | {err:.1e} |",
                flush=True,
            )


def main() -> int:
    import triton.testing

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="128,256,512")
    p.add_argument("--split-k", default="", help="time split-K candidates for this GEMM (e.g. down) instead")
    p.add_argument("--shapes", choices=("native", "hf"), default="native", help="the native engine's layer or HF's")
    p.add_argument("--inductor", action="store_true", help="inductor's max-autotune against cuBLAS instead")
    p.add_argument("--fp8", action="store_true", help="fp8 weights and activations (torch._scaled_mm) instead")
    args = p.parse_args()
    if args.fp8:
        fp8_table([int(b) for b in args.batches.split(",")])
        return 0
    if args.inductor:
        inductor_table([int(b) for b in args.batches.split(",")])
        return 0
    if args.split_k:
        split_k_table(args.split_k, [int(b) for b in args.batches.split(",")])
        return 0
    print(f"CUBLASLT_WORKSPACE_SIZE={os.environ.get('CUBLASLT_WORKSPACE_SIZE', 'unset')}")
    print("| M | GEMM | library | us | floor us | of floor |")
    print("| ---: | --- | --- | ---: | ---: | ---: |")
    for m in (int(b) for b in args.batches.split(",")):
        for name, (n, k) in (HF_SHAPES if args.shapes == "hf" else SHAPES).items():
            x, w = operands(m, n, k)
            floor = max(n * k * 2 / BANDWIDTH, 2 * m * n * k / MATMUL) * 1e6
            for library in ("cublaslt", "cublas"):
                torch.backends.cuda.preferred_blas_library(library)
                us = triton.testing.do_bench_cudagraph(lambda x=x, w=w: torch.nn.functional.linear(x, w)) * 1e3
                print(f"| {m} | {name} | {library} | {us:.1f} | {floor:.1f} | {floor / us:.0%} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
