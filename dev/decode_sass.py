"""The decode-attention kernels compiled for the H200 (sm_90) on any machine, no GPU needed:
registers, local-memory stack (spills), and the main loop's instructions per key and KV head.

    python3 dev/decode_sass.py                                  # the fp8 and bf16 launches the sweep times
    python3 dev/decode_sass.py --kernel pairs --kv fp8 --block-n 64 --warps 4 --stages 2

Triton compiles to PTX and its bundled ptxas to SASS (triton/backends/nvidia/bin), with the
16-byte divisibility the JIT would see for these pointers and strides at run time (without it the
loads do not vectorise and the counts mean nothing). The loop's length in instructions per warp,
times the warps, over the keys a trip reads, is the issue cost per (key, KV head): at 4 warp
instructions per clock per multiprocessor, 132 of them at 1.98 GHz, 64 rows x 27,700 keys x 2 KV
heads take (count x 3.55M / 1.05e12) seconds at full issue rate. Also printed: the matrix
instructions (HMMA: mma.sync; HGMMA: Hopper's wgmma), the conversions to and from fp8 (F2FP),
byte permutes (PRMT), the global loads (LDGSTS: asynchronous copies into shared memory, with
their width), the shared-memory matrix loads (LDSM: ldmatrix) and local-memory traffic (STL/LDL:
spills), barriers (BAR). Kernels: the bf16/dequantizing one (`default`), the one that reads an
8-bit cache as int16 pairs of head dims (`pairs`, decode_attention_fp8_pairs; fp8 only), and the
candidates of dev/fp8_pairs_next.py: `next` (the pairs kernel with its three flags on), `wb` and
`wb16` (warp-batched over the pairs and over a bf16 cache; `--maxnreg` caps their registers).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import fp8_pairs_next as nx
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from minirl_plugins.engines.native.layers import paged_attention as pa

KERNELS = {
    "default": pa._decode_kernel,
    "pairs": pa._decode_kernel_fp8_pairs,  # the cache viewed as int16, the pairs split by inline PTX
    "next": nx._next_kernel,  # candidates (dev/fp8_pairs_next.py): the pairs kernel with SPLIT, EXP2, OFF32
    "wb": nx._wb_kernel,  # warp-batched over the pairs
    "wb16": nx._wb16_kernel,  # warp-batched over a bf16 cache
}
KV = {"fp8": "fp8e4nv", "bf16": "bf16"}
SIGNATURE = {
    "q_ptr": "*bf16",
    "k_ptr": None,
    "v_ptr": None,
    "pt_ptr": "*i32",
    "rows_ptr": "*i64",
    "lens_ptr": "*i32",
    "o_ptr": "*fp32",
    "lse_ptr": "*fp32",
    "stride_q": "i32",
    "stride_slot": "i32",
    "stride_pt": "i32",
    "stride_o": "i32",
    "scale": "fp32",
    "min_chunk": "i32",
}
DIVISIBLE = [k for k in SIGNATURE if k != "scale"]
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
SHOWN = ("HGMMA", "HMMA", "F2FP", "PRMT", "LDGSTS", "LDG", "LDSM", "STL", "LDL", "MUFU", "BAR")


def kernel_args(name: str, kv: str, block_n: int, warps: int) -> tuple[str, dict]:
    """The cache pointers' element type and the kernel's constexprs: the pairs kernel reads an
    8-bit cache as int16 (e4m3, its pairs split by inline PTX); the default one reads `kv` as it is."""
    consts = dict(H=12, D=128, G=6, BLOCK_G=16, BLOCK_N=block_n, PAGE=16, SPLITS=16, DIRECT=False)
    if name == "wb16":
        assert kv == "bf16", "wb16 reads a 16-bit cache"
        return "bf16", dict(consts, W=warps)
    if name in ("pairs", "next", "wb"):
        assert kv == "fp8", f"the {name} kernel reads an 8-bit cache"
        consts = dict(consts, PTX=pa.PAIRS_PTX[torch.float8_e4m3fn], E5M2=False)
        if name == "next":  # the flags as the engine's kernel now has them
            consts.update(SPLIT=True, EXP2=True)
        consts.update(OFF32=True)
        return "i16", dict(consts, W=warps) if name == "wb" else consts
    return KV[kv], dict(consts, PRECISION="tf32", KV_F16=kv == "fp8")


def compile_sass(name: str, kv: str, block_n: int, warps: int, stages: int, maxnreg=None) -> tuple[str, str]:
    kv_type, consts = kernel_args(name, kv, block_n, warps)
    sig = dict(SIGNATURE, k_ptr=f"*{kv_type}", v_ptr=f"*{kv_type}")
    sig.update({k: "constexpr" for k in consts})
    names = list(sig)
    src = ASTSource(
        fn=KERNELS[name],
        signature=sig,
        constexprs={(names.index(k),): v for k, v in consts.items()},
        attrs={(names.index(k),): [["tt.divisibility", 16]] for k in DIVISIBLE},
    )
    options = {"num_warps": warps, "num_stages": stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([f"{BIN}/cuobjdump", "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([f"{BIN}/nvdisasm", f.name], capture_output=True, text=True).stdout
    return usage, sass


def loop_body(sass: str) -> list[str]:
    """The instructions of the longest backward branch's body (the loop over key blocks)."""
    labels, lines, current = {}, [], None
    for raw in sass.splitlines():
        label = re.match(r"\s*\.L_x_(\d+):", raw)
        if label:
            current = label.group(1)
            continue
        at = re.search(r"/\*([0-9a-f]{4,})\*/\s+([@A-Z].*)", raw)
        if at:
            lines.append((int(at.group(1), 16), at.group(2)))
            if current is not None:
                labels.setdefault(current, len(lines) - 1)
                current = None
    best: list[str] = []
    for i, (_, text) in enumerate(lines):
        target = re.search(r"BRA.*\.L_x_(\d+)", text)
        if target and labels.get(target.group(1), i) < i and i - labels[target.group(1)] > len(best):
            best = [t for _, t in lines[labels[target.group(1)] : i + 1]]
    return best


def report(name: str, kv: str, block_n: int, warps: int, stages: int, maxnreg=None) -> str:
    usage, sass = compile_sass(name, kv, block_n, warps, stages, maxnreg)
    regs = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    body = loop_body(sass)
    ops = collections.Counter(re.match(r"(?:@!?U?P\w+\s+)?([A-Z0-9_]+(?:\.[A-Z0-9_]+)*)", t).group(1) for t in body)
    mix = ", ".join(f"{op} {n}" for op, n in ops.most_common() if op.startswith(SHOWN))
    per_key = len(body) * warps / block_n
    return (
        f"| {name} | {kv} | {block_n} | {warps} | {stages} | {regs.group(1)} | {regs.group(2)} "
        f"| {len(body)} | {per_key:.1f} | {mix} |"
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kernel", choices=sorted(KERNELS))
    p.add_argument("--kv", choices=sorted(KV))
    p.add_argument("--block-n", type=int)
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--maxnreg", type=int, help="a register cap (the launch's maxnreg)")
    args = p.parse_args()
    if args.kernel:
        kv = args.kv or ("bf16" if args.kernel == "wb16" else "fp8")
        launches = [(args.kernel, kv, args.block_n or 64, args.warps, args.stages, args.maxnreg)]
    else:
        launches = [
            ("default", "bf16", 64, 4, 3),
            ("default", "fp8", 32, 4, 3),
            ("default", "fp8", 128, 4, 3),
            ("pairs", "fp8", 64, 4, 2),
        ]
    print("| kernel | kv | block_n | warps | stages | registers | stack B | loop instr/warp | per key+head | mix |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for launch in launches:
        print(report(*launch), flush=True)


if __name__ == "__main__":
    main()
