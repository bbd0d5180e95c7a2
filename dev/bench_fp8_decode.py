"""Decode attention over an fp8 (e4m3) KV cache: the fp8 tensor-core kernel against the others.

    python3 dev/bench_fp8_decode.py                          # every launch, each in its own process
    python3 dev/bench_fp8_decode.py --launch e4m3_vt:64:4:3  # one launch, in this process

Cases: 64 rows x 27,700 and x 14,000 keys (the `h200-long` batch at a 27,648-token budget, at its
end and half way), and 256 rows x 600 keys (a short-context batch). Qwen2-1.5B's heads (12 query,
2 KV, dim 128), 16-token pages in shuffled order. Per launch: the median time (CUDA graph
replay), the effective bandwidth (the KV bytes the rows attend to, read once, over the time) and
the error against the gathered SDPA reference in float32.

Launches (kernel:block_n:warps:stages): `bf16` the default kernel over a bf16 cache (the
ceiling's reference); `fp8_now` the default kernel over an fp8 cache (keys and values upcast to
float16); `e4m3_vt` _decode_kernel_e4m3 over page-transposed values; `e4m3_tm` the same kernel
over the token-major value cache (the values transposed in registers). Each launch runs in its own
process so that a fault in one does not end the sweep.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import torch
import triton.testing
from bench_long_context import HEADS, PAGE, paged_case, rel_err  # the same cache (this folder is on sys.path)

from minirl_plugins.engines.native.layers import paged_attention as pa
from minirl_plugins.engines.native.layers.kv_layout import transposed_pages

CASES = ((64, 27700), (64, 14000), (256, 600))
LAUNCHES = (
    "bf16:0:0:0",
    "fp8_now:0:0:0",
    "e4m3_vt:64:4:3",
    "e4m3_vt:64:4:4",
    "e4m3_vt:128:4:3",
    "e4m3_vt:128:8:3",
    "e4m3_vt:128:8:4",
    "e4m3_vt:32:4:4",
    "e4m3_tm:64:4:3",
    "e4m3_tm:128:8:3",
)


def launch_fn(kernel: str, launch: tuple[int, int, int], qkv, kc, vc, meta):
    """The decode attention call that `kernel` names, at (block_n, warps, stages)."""
    if kernel in ("bf16", "fp8_now"):
        return lambda: pa.decode_attention_triton(qkv, kc, vc, meta, HEADS, 128**-0.5)
    cfg = dict(zip(("block_n", "num_warps", "num_stages"), launch))
    v = transposed_pages(vc, PAGE) if kernel == "e4m3_vt" else vc
    return lambda: pa.decode_attention_e4m3(qkv, kc, v, meta, HEADS, 128**-0.5, config=cfg)


def one_launch(launch: str, splits_override: int) -> list[str]:
    kernel, block_n, warps, stages = launch.split(":")
    kv_dtype = torch.bfloat16 if kernel == "bf16" else torch.float8_e4m3fn
    lines = []
    for rows, ctx in CASES:
        qkv, kc, vc, meta = paged_case(rows, ctx, kv_dtype)
        meta.num_splits = splits_override or pa.num_splits(rows, HEADS.num_kv_heads, qkv.device)
        fn = launch_fn(kernel, (int(block_n), int(warps), int(stages)), qkv, kc, vc, meta)
        ref = pa.decode_attention(qkv.float(), kc, vc, meta, HEADS, 128**-0.5)
        err = rel_err(fn(), ref)
        us = triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median") * 1e3
        kv_bytes = 2 * rows * ctx * HEADS.num_kv_heads * HEADS.head_dim * kv_dtype.itemsize
        lines.append(
            f"| {launch} | {rows} x {ctx} | {meta.num_splits} | {us:.1f} | {kv_bytes / us / 1e6:.2f} | {err:.1e} |"
        )
        print(lines[-1], flush=True)
        del qkv, kc, vc, meta, ref
        torch.cuda.empty_cache()
    return lines


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--launch", help="kernel:block_n:warps:stages, run here; default: every launch, one process each")
    p.add_argument("--splits", type=int, default=0, help="split-K programs per row and KV head (0: the engine's)")
    args = p.parse_args()
    if args.launch:
        one_launch(args.launch, args.splits)
        return 0
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    rows = ["| launch | rows x keys | splits | us | TB/s | rel err |", "|---|---|---:|---:|---:|---:|"]
    for launch in LAUNCHES:
        cmd = [sys.executable, __file__, "--launch", launch, "--splits", str(args.splits)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        rows += [line for line in done.stdout.splitlines() if line.startswith("| ")]
        if done.returncode:
            rows.append(f"| {launch} | failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1][:160]} |")
        print(rows[-1], flush=True)
    print("\n" + "\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
