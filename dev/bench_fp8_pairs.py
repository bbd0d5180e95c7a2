"""Decode attention over an fp8 (e4m3) cache read as 16-bit pairs, against the other kernels.

    python3 dev/bench_fp8_pairs.py
    python3 dev/bench_fp8_pairs.py --splits 0,8,16    # each launch also at 8 and 16 splits
    python3 dev/bench_fp8_pairs.py --launches pairs:64:4:2,next-seo:64:4:2,next-seo:32:1:2

decode_attention_fp8_pairs (paged_attention) views the cache as int16, two e4m3 values of
adjacent head dims per element, so its tiles move like a bf16 cache's (128-bit copies, ldmatrix)
and are split into float16 in registers (`pairs:block_n:warps:stages`, at several launches); the
dequantizing kernel (`fp8_now`, decode_attention_triton) reads 8-bit tiles into the 16-bit
matrix operands by scalar shared-memory loads; `bf16` is the default kernel over a bf16 cache,
the ceiling's reference. One process, at 64 rows x 27,700 and 14,000 keys and 256 rows x 600
(Qwen2-1.5B's heads, 16-token pages in shuffled order, the engine's split count): each launch's
median time under a CUDA graph, effective bandwidth (the KV bytes the rows attend to, read once)
and error against the float32 reference. `next-<flags>:block_n:warps:stages` launches are the
candidate kernel of dev/fp8_pairs_next.py, its flags by letter: s (SPLIT), e (EXP2), o (OFF32);
`pairs-k:...` is the pairs kernel with its splits merged by a second kernel (_merge_kernel),
`pairs-l:...` by each row's last program (_merge_if_last); `wb:block_n:warps:stages` the warp-batched kernel of
fp8_pairs_next (a running softmax per warp, merged at the end), `wb16:...` the same over a bf16
cache (against `bf16`, the default kernel).
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
import triton
import triton.testing
from bench_long_context import HEADS, paged_case, rel_err
from fp8_pairs_next import decode_attention_next, decode_attention_wb, decode_attention_wb16

from minirl_plugins.engines.native.layers import paged_attention as pa

CASES = ((64, 27700), (64, 14000), (256, 600))


PAIRS = [(32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 4, 3), (128, 8, 3), (64, 8, 3)]
LAUNCHES = [("bf16", None), ("fp8_now", None)]
LAUNCHES += [(f"pairs:{bn}:{w}:{s}", dict(block_n=bn, num_warps=w, num_stages=s)) for bn, w, s in PAIRS]


def parse_launch(text: str):
    """'bf16', 'fp8_now', or '<kernel>:block_n:warps:stages' -> (name, config)."""
    if text in ("bf16", "fp8_now"):
        return text, None
    _, bn, w, s, *cap = text.split(":")
    return text, dict(block_n=int(bn), num_warps=int(w), num_stages=int(s), maxnreg=int(cap[0]) if cap else None)


def launch_fn(name: str, cfg, qkv, kc, vc, meta):
    """The decode attention call that `name` names."""
    args = (qkv, kc, vc, meta, HEADS, 128**-0.5)
    if name in ("bf16", "fp8_now"):
        return lambda: pa.decode_attention_triton(*args)
    if name.startswith("next"):
        flags = name.partition("-")[2].split(":")[0]
        opts = dict(split="s" in flags, exp2="e" in flags, off32="o" in flags)
        return lambda: decode_attention_next(*args, config=cfg, **opts)
    if name.startswith("wb16"):
        return lambda: decode_attention_wb16(*args, config=cfg)
    if name.startswith("wb"):
        return lambda: decode_attention_wb(*args, config=cfg)
    if name.startswith("pairs-"):  # pairs-k: its splits merged by _merge_kernel; pairs-l: by each row's last program
        cfg = {**(cfg or {}), "merge": "kernel" if name.startswith("pairs-k") else "last"}
    return lambda: pa.decode_attention_fp8_pairs(*args, config=cfg)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--splits", default="0", help="split-K counts, comma-separated (0: the engine's)")
    p.add_argument("--launches", default="", help="launch names, comma-separated (default: the sweep's)")
    args = p.parse_args()
    splits = [int(x) for x in args.splits.split(",")]
    launches = [parse_launch(x) for x in args.launches.split(",")] if args.launches else LAUNCHES
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    rows = ["| launch | rows x keys | splits | us | TB/s | rel err |", "|---|---|---:|---:|---:|---:|"]
    for rows_n, ctx in CASES:
        cases = {dt: paged_case(rows_n, ctx, dt) for dt in (torch.bfloat16, torch.float8_e4m3fn)}
        for (name, cfg), split in itertools.product(launches, splits):
            kv_dtype = torch.bfloat16 if name == "bf16" or name.startswith("wb16") else torch.float8_e4m3fn
            qkv, kc, vc, meta = cases[kv_dtype]
            meta.num_splits = split or pa.num_splits(rows_n, HEADS.num_kv_heads, qkv.device)
            try:
                fn = launch_fn(name, cfg, qkv, kc, vc, meta)
                ref = pa.decode_attention(qkv.float(), kc, vc, meta, HEADS, 128**-0.5)
                err = rel_err(fn(), ref)
                us = triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median") * 1e3
            except Exception as exc:  # a launch that does not compile: say so, go on
                rows.append(f"| {name} | {rows_n} x {ctx} | failed: {type(exc).__name__}: {str(exc)[:120]} |")
                print(rows[-1], flush=True)
                continue
            kv_bytes = 2 * rows_n * ctx * HEADS.num_kv_heads * HEADS.head_dim * kv_dtype.itemsize
            rows.append(
                f"| {name} | {rows_n} x {ctx} | {meta.num_splits} | {us:.1f} | {kv_bytes / us / 1e6:.2f} | {err:.1e} |"
            )
            print(rows[-1], flush=True)
        del cases
        torch.cuda.empty_cache()
    print("\n" + "\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
