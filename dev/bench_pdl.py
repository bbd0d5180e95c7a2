"""Does programmatic dependent launch (PDL) take back the ramp and tail a decode layer's kernels pay?

    python3 dev/bench_pdl.py                           # on an H100 or H200 (sm_90: PDL needs it)
    python3 dev/bench_pdl.py --batches 64 --ring 8

At 64 rows a Qwen2-1.5B layer's four fp8 GEMMs take ~30 µs chained where their weights' bytes take
14: each kernel waits for the one before to drain before its first program starts, then ramps
up. With PDL (Hopper's griddepcontrol; Triton's `launch_pdl=True`, `gdc_wait`,
`gdc_launch_dependents`) a kernel's programs start while the one before is still finishing: they
may do anything that does not read what it writes before `gdc_wait`, such as loading their weight
tiles. A layer-like chain, one layer per weight copy of a `--ring` (out of L2), each GEMM followed
by the kernel that reads its float32 partials (sums the K slices and quantizes to e4m3 the next
GEMM's input, as a fused reader would), all data-dependent:

    off     plain launches
    pdl     every kernel launched with PDL, waiting first thing (what it takes back: launch gaps)
    reg     pdl, the GEMM loading its first weight tile before the wait (into registers)
    l2      pdl, the GEMM prefetching its whole weight slice into L2 before the wait
    cublas  the GEMMs cuBLASLt's (torch._scaled_mm, bf16 out), plain launches
    cublas_pdl  cublas, the readers launched with PDL (what the engine could have without Triton GEMMs)

Every variant's chain output is compared bit for bit with `off` (`cublas` for cuBLAS's; a race
shows as a mismatch), and each Triton GEMM once against float32.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from bench_fp8_mm import E4M3, SHAPES, ring_of

ORDER = ("qkv", "o", "gate_up", "down")
# name: (readers and Triton GEMMs launched with PDL, what a Triton GEMM does before its wait, GEMM)
VARIANTS = {
    "off": (False, 0, "triton"),
    "pdl": (True, 0, "triton"),
    "reg": (True, 1, "triton"),
    "l2": (True, 2, "triton"),
    "cublas": (False, 0, "cublas"),
    "cublas_pdl": (True, 0, "cublas"),
}
# (BM, BN, BK, SPLIT, warps) per batch and GEMM: dev/bench_fp8_mm.py's best on an H100
CONFIGS = {
    64: {
        "qkv": (64, 64, 128, 4, 4),
        "o": (64, 64, 128, 4, 4),
        "gate_up": (64, 64, 128, 1, 4),
        "down": (64, 64, 256, 5, 4),
    },
    256: {
        "qkv": (64, 64, 128, 4, 4),
        "o": (64, 64, 128, 4, 4),
        "gate_up": (128, 128, 128, 1, 8),
        "down": (128, 128, 128, 5, 8),
    },
}


@triton.jit
def _prefetch_l2(ptr):
    return tl.inline_asm_elementwise(
        "prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _mm_kernel(
    x_ptr,
    w_ptr,
    p_ptr,
    M,
    N: tl.constexpr,
    K: tl.constexpr,
    SPLIT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GDC: tl.constexpr,
    PRE: tl.constexpr,
    LINES: tl.constexpr,
):
    """p[slice, rows, tile] = x[rows, slice] @ w[tile, slice]^T in float32 (e4m3 operands)."""
    pid_n, pid_s, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ks: tl.constexpr = K // SPLIT
    iters: tl.constexpr = ks // BK
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    wp = w_ptr + rn[None, :] * K + (pid_s * ks + rk)[:, None]
    if PRE == 2:  # the program's whole weight slice, 128-byte lines, into L2
        line = tl.minimum(tl.arange(0, LINES), ks // 128 - 1)  # a power of 2 of them, the last repeated
        lines = rn[:, None] * K + pid_s * ks + line[None, :] * 128
        _prefetch_l2(w_ptr + lines)
    if PRE == 1:
        w0 = tl.load(wp)
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    xp = x_ptr + rm[:, None] * K + (pid_s * ks + rk)[None, :]
    acc = tl.zeros((BM, BN), tl.float32)
    start: tl.constexpr = 1 if PRE == 1 else 0
    if PRE == 1:
        acc = tl.dot(tl.load(xp, mask=rm[:, None] < M, other=0.0), w0, acc)
        xp += BK
        wp += BK
    for _ in range(start, iters):
        acc = tl.dot(tl.load(xp, mask=rm[:, None] < M, other=0.0), tl.load(wp), acc)
        xp += BK
        wp += BK
    tl.store(p_ptr + (pid_s * M + rm[:, None]) * N + rn[None, :], acc, mask=rm[:, None] < M)


@triton.jit
def _reader_kernel(
    p_ptr, x_ptr, c, M, N: tl.constexpr, KN: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr
):
    """x[row, :KN] = e4m3(clamp(c * sum over slices of p[slice, row, :KN]))."""
    row, blk = tl.program_id(0), tl.program_id(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < KN
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in range(SPLIT):
        acc += tl.load(p_ptr + (s * M + row) * N + cols, mask=mask, other=0.0)
    y = tl.clamp(acc * c, -448.0, 448.0)
    tl.store(x_ptr + row * KN + cols, y.to(x_ptr.dtype.element_ty), mask=mask)


def mm(x, w, p, cfg, gdc: bool, pre: int) -> None:
    m, (n, k) = x.shape[0], w.shape
    bm, bn, bk, split, warps = cfg
    grid = (n // bn, split, triton.cdiv(m, bm))
    _mm_kernel[grid](
        x,
        w,
        p,
        m,
        N=n,
        K=k,
        SPLIT=split,
        BM=bm,
        BN=bn,
        BK=bk,
        GDC=gdc,
        PRE=pre,
        LINES=triton.next_power_of_2(k // split // 128),
        num_warps=warps,
        num_stages=3,
        launch_pdl=gdc,
    )


def reader(p, x, c: float, gdc: bool) -> None:
    split, m, n = p.shape
    kn = x.shape[1]
    block = 1024
    _reader_kernel[(m, triton.cdiv(kn, block))](
        p, x, c, m, N=n, KN=kn, SPLIT=split, BLOCK=block, GDC=gdc, num_warps=4, launch_pdl=gdc
    )


class Chain:
    """`ring` layers of four GEMMs, each followed by its partials' reader; all buffers preallocated."""

    def __init__(self, m: int, ring: int, configs: dict):
        self.m, self.ring, self.configs = m, ring, configs
        rings = {name: ring_of(n, k, ring) for name, (n, k) in SHAPES.items()}
        self.weights = {name: ws for name, (ws, _) in rings.items()}
        # each reader's factor: the next GEMM's input about as large as this one's
        self.c = {name: float(scale) / (0.05 * SHAPES[name][1] ** 0.5) for name, (_, scale) in rings.items()}
        self.x = {name: torch.zeros(m, SHAPES[name][1], device="cuda", dtype=E4M3) for name in ORDER}
        self.p = {name: torch.empty(configs[name][3], m, SHAPES[name][0], device="cuda") for name in ORDER}
        self.x0 = (torch.randn(m, SHAPES[ORDER[0]][1], device="cuda") * 100).clamp(-448, 448).to(E4M3)
        self.one = torch.ones((), device="cuda")

    def run(self, gdc: bool, pre: int, gemm: str) -> None:
        """With gemm "cublas" the GEMMs are torch._scaled_mm's (cuBLASLt, never launched with PDL)
        and their bf16 outputs the readers' one slice."""
        self.x["qkv"].copy_(self.x0)
        for i in range(self.ring):
            for j, name in enumerate(ORDER):
                w = self.weights[name][i]
                if gemm == "cublas":
                    p = torch._scaled_mm(self.x[name], w.t(), self.one, self.one, out_dtype=torch.bfloat16)[None]
                else:
                    p = self.p[name]
                    mm(self.x[name], w, p, self.configs[name], gdc, pre)
                reader(p, self.x[ORDER[(j + 1) % len(ORDER)]], self.c[name], gdc)

    def matches(self, want: dict) -> bool:
        """Every GEMM input the chain left, bit for bit as in `want`."""
        return all(torch.equal(self.x[name].view(torch.uint8), want[name].view(torch.uint8)) for name in ORDER)

    def check_gemms(self) -> None:
        for name in ORDER:
            x = (torch.randn(self.m, SHAPES[name][1], device="cuda") * 100).clamp(-448, 448).to(E4M3)
            w = self.weights[name][0]
            ref = x.float() @ w.float().t()
            for gdc, pre in {(g, q) for g, q, gemm in VARIANTS.values() if gemm == "triton"}:
                mm(x, w, self.p[name], self.configs[name], gdc, pre)
                got = self.p[name].sum(0)
                err = ((got - ref).norm() / ref.norm()).item()
                assert err < 2e-3, (name, gdc, pre, err)  # fp8 tensor-core sums keep fewer bits than float32


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--ring", type=int, default=8)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    bench = triton.testing.do_bench_cudagraph
    print(torch.cuda.get_device_name(0), "| ring", args.ring, flush=True)
    rows = []
    for m in (int(b) for b in args.batches.split(",")):
        chain = Chain(m, args.ring, CONFIGS[m])
        chain.check_gemms()
        want = {}
        for gemm in ("triton", "cublas"):
            chain.run(False, 0, gemm)
            want[gemm] = {name: x.clone() for name, x in chain.x.items()}
        for v in args.variants.split(","):
            gdc, pre, gemm = VARIANTS[v]
            chain.run(gdc, pre, gemm)
            same = chain.matches(want[gemm])
            us = bench(lambda ch=chain, g=gdc, q=pre, k=gemm: ch.run(g, q, k)) * 1e3 / args.ring
            same = same and chain.matches(want[gemm])  # and after the graph's replays
            rows.append((m, v, us, same))
            print(f"M={m} {v}: {us:.1f} us a layer (8 kernels), output", "identical" if same else "DIFFERS", flush=True)
    weight_us = sum(n * k for n, k in SHAPES.values()) / 3.35e6
    print(f"\nweights' bytes a layer at 3.35 TB/s: {weight_us:.1f} us")
    print("| M | variant | µs a layer | output vs plain launches |")
    print("| ---: | --- | ---: | --- |")
    for m, v, us, same in rows:
        print(f"| {m} | {v} | {us:.1f} | {'identical' if same else 'DIFFERS'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
