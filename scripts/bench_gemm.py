"""Time the decode step's GEMMs (bf16, y = x W^T) per cuBLAS back end, against their floors.

    python3 scripts/bench_gemm.py                                   # the default back end, both libraries
    CUBLASLT_WORKSPACE_SIZE=65536 python3 scripts/bench_gemm.py     # a larger cuBLASLt workspace (KiB)

Floor of each: max(weight bytes / 4.28 TB/s, FLOPs / 768 TFLOP/s), the H200's measured copy
bandwidth and bf16 matmul ceiling. Shapes: the Qwen2-1.5B layer at decode batch M.
"""

from __future__ import annotations

import argparse
import os

import torch

BANDWIDTH, MATMUL = 4.28e12, 768e12
SHAPES = {
    "qkv": (2048, 1536),
    "o_proj": (1536, 1536),
    "gate_up": (17920, 1536),
    "down": (1536, 8960),
    "lm_head": (151936, 1536),
}


def main() -> int:
    import triton.testing

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="128,256,512")
    args = p.parse_args()
    print(f"CUBLASLT_WORKSPACE_SIZE={os.environ.get('CUBLASLT_WORKSPACE_SIZE', 'unset')}")
    print("| M | GEMM | library | us | floor us | of floor |")
    print("| ---: | --- | --- | ---: | ---: | ---: |")
    for m in (int(b) for b in args.batches.split(",")):
        for name, (n, k) in SHAPES.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            floor = max(n * k * 2 / BANDWIDTH, 2 * m * n * k / MATMUL) * 1e6
            for library in ("cublaslt", "cublas"):
                torch.backends.cuda.preferred_blas_library(library)
                us = triton.testing.do_bench_cudagraph(lambda x=x, w=w: torch.nn.functional.linear(x, w)) * 1e3
                print(f"| {m} | {name} | {library} | {us:.1f} | {floor:.1f} | {floor / us:.0%} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
