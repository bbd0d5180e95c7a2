"""Could a Triton fp8 GEMM beat cuBLASLt's at the decode's 64 and 256 rows? A prototype, timed.

    python3 dev/bench_fp8_mm.py                      # on a CUDA machine with fp8 tensor cores
    python3 dev/bench_fp8_mm.py --batches 64 --ring 8

The engine's fp8 GEMMs (rollout.quantization = "fp8") run torch._scaled_mm, cuBLASLt's
per-tensor kernel. At 64 rows the four of a Qwen2-1.5B layer (46.8 MB of e4m3 weights, 14 µs at
an H100's 3.35 TB/s) take about 35 µs chained, where each alone takes a little more than its
bytes: the chain pays every launch's ramp and tail, and down (N = 1,536 over K = 8,960) has 12
output tiles of 128 for 132 multiprocessors. The prototype: one program per output tile and K
slice (split-K), e4m3 dots on the tensor cores summed in float32; with one slice it writes the
result times the weight's scale in bf16, with more its float32 partials (which the op reading
the result would sum; timed here with and without a torch sum).

Every timing cycles through `--ring` copies of each weight (a layer's weights are not in L2 when
the next decode step reaches them: 28 layers of them are 1.3 GB), in a CUDA graph. Each launch
is checked against the float32 reference first.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

SHAPES = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960)}
E4M3 = torch.float8_e4m3fn


@triton.jit
def _fp8_mm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    s_ptr,
    M,
    stride_x,
    N: tl.constexpr,
    K: tl.constexpr,
    SPLIT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """y[:, tile] = x @ w[tile]^T over K slice program_id(1): bf16 times scale with one slice,
    else float32 partials y[slice]."""
    pid_n, pid_s, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    ks: tl.constexpr = K // SPLIT
    xp = x_ptr + rm[:, None] * stride_x + (pid_s * ks + rk)[None, :]
    wp = w_ptr + rn[None, :] * K + (pid_s * ks + rk)[:, None]
    acc = tl.zeros((BM, BN), tl.float32)
    for _ in range(ks // BK):
        a = tl.load(xp, mask=rm[:, None] < M, other=0.0)
        acc = tl.dot(a, tl.load(wp), acc)
        xp += BK
        wp += BK
    if SPLIT == 1:
        out = (acc * tl.load(s_ptr)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], out, mask=rm[:, None] < M)
    else:
        tl.store(y_ptr + (pid_s * M + rm[:, None]) * N + rn[None, :], acc, mask=rm[:, None] < M)


def fp8_mm(x, w, scale, cfg, out=None):
    """x [M, K] e4m3, w [N, K] e4m3: [M, N] bf16 (one slice) or [SPLIT, M, N] float32 partials."""
    m, (n, k) = x.shape[0], w.shape
    bm, bn, bk, split, warps, stages = cfg
    assert n % bn == 0 and k % (split * bk) == 0, (n, k, cfg)
    if out is None:
        out = torch.empty(
            (m, n) if split == 1 else (split, m, n),
            device=x.device,
            dtype=torch.bfloat16 if split == 1 else torch.float32,
        )
    grid = (n // bn, split, triton.cdiv(m, bm))
    _fp8_mm_kernel[grid](
        x, w, out, scale, m, x.stride(0), N=n, K=k, SPLIT=split, BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages
    )
    return out


def candidates(m: int, n: int, k: int, sms: int) -> list[tuple]:
    """(BM, BN, BK, SPLIT, warps, stages) launches to sweep for one shape: tiles of 64 or 128
    columns, K blocks of 128 or 256, the splits that bring the programs to one or two waves."""
    out = []
    bms = (64,) if m <= 64 else (64, 128)
    for bm in bms:
        for bn in (64, 128):
            tiles = (n // bn) * triton.cdiv(m, bm)
            for bk in (128, 256):
                for split in sorted({1, 2, 4, 5, 7, 8, 10, 14, 16}):
                    if k % (split * bk) or tiles * split > 4 * sms or (split > 1 and tiles * split < sms // 2):
                        continue
                    for warps, stages in ((4, 3), (4, 4)):
                        out.append((bm, bn, bk, split, warps, stages))
    return out


def ring_of(n: int, k: int, ring: int):
    ws = [(torch.randn(n, k, device="cuda") * 0.05) for _ in range(ring)]
    scale = torch.tensor(0.05 * 4 / 448.0, device="cuda")
    return [(w / scale).clamp(-448, 448).to(E4M3) for w in ws], scale


def chained(m: int, best: dict, ring: int, bench, one) -> None:
    """A layer's four GEMMs one after another over `ring` layers' weights: cuBLASLt against the
    Triton launches found best (their float32 partials left unsummed, as a fused reader would)."""
    layers, xs = [], {}
    for name, (n, k) in SHAPES.items():
        ws, scale = ring_of(n, k, ring)
        layers.append((name, ws, scale))
        xs[k] = (torch.randn(m, k, device="cuda") * 100).clamp(-448, 448).to(E4M3)
    bufs = {name: fp8_mm(xs[SHAPES[name][1]], ws[0], scale, best[(m, name)]) for name, ws, scale in layers}

    def run_cublas():
        for i in range(ring):
            for name, ws, scale in layers:
                torch._scaled_mm(xs[SHAPES[name][1]], ws[i].t(), one, scale, out_dtype=torch.bfloat16)

    def run_triton():
        for i in range(ring):
            for name, ws, scale in layers:
                fp8_mm(xs[SHAPES[name][1]], ws[i], scale, best[(m, name)], bufs[name])

    cb, tr = (bench(f) * 1e3 / ring for f in (run_cublas, run_triton))
    print(f"M={m}: a layer's four GEMMs chained: cuBLASLt {cb:.1f} us, Triton {tr:.1f} us", flush=True)


def sweep(name: str, m: int, ring: int, bench, one, sms: int):
    """(cuBLASLt µs, sorted [(µs, launch)], the best launch's µs with a torch sum of its partials)."""
    n, k = SHAPES[name]
    ws, scale = ring_of(n, k, ring)
    x = (torch.randn(m, k, device="cuda") * 100).clamp(-448, 448).to(E4M3)
    ref = (x.float() @ ws[0].float().t()) * scale
    cublas = bench(lambda: [torch._scaled_mm(x, w.t(), one, scale, out_dtype=torch.bfloat16) for w in ws]) * 1e3
    results = []
    for cfg in candidates(m, n, k, sms):
        try:
            got = fp8_mm(x, ws[0], scale, cfg)
            got = got.float() if cfg[3] == 1 else got.sum(0) * scale
            err = ((got - ref).norm() / ref.norm()).item()
            if err > 1e-2:
                print(f"  {name} M={m} {cfg}: wrong, relative error {err:.2e}")
                continue
            buf = fp8_mm(x, ws[0], scale, cfg)
            us = bench(lambda c=cfg, b=buf: [fp8_mm(x, w, scale, c, b) for w in ws]) * 1e3
            results.append((us / ring, cfg))
        except Exception as exc:  # out of shared memory and the like: not a candidate
            print(f"  {name} M={m} {cfg}: {type(exc).__name__}: {str(exc)[:100]}")
    results.sort()
    summed = None
    if results and results[0][1][3] > 1:
        part = fp8_mm(x, ws[0], scale, results[0][1])
        summed = results[0][0] + bench(lambda: part.sum(0)) * 1e3
    return cublas / ring, results, summed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="64,256")
    p.add_argument("--ring", type=int, default=8)
    p.add_argument("--shapes", default=",".join(SHAPES))
    args = p.parse_args()
    bench = triton.testing.do_bench_cudagraph
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    one = torch.ones((), device="cuda")
    print(torch.cuda.get_device_name(0), "| ring", args.ring)
    best, rows = {}, []
    for m in (int(b) for b in args.batches.split(",")):
        for name in args.shapes.split(","):
            cublas, results, summed = sweep(name, m, args.ring, bench, one, sms)
            if not results:
                continue
            best[(m, name)] = results[0][1]
            rows.append((m, name, cublas, results, summed))
            print(
                f"{name} M={m}: cuBLASLt {cublas:.1f} us, Triton best {results[0][0]:.1f} us {results[0][1]}",
                flush=True,
            )
    for m in sorted({m for m, _ in best}):
        if all((m, name) in best for name in SHAPES):
            chained(m, best, args.ring, bench, one)
    print(
        "\n| M | GEMM | cuBLASLt µs | Triton µs | + torch sum | launch (BM, BN, BK, split, warps, stages) | bytes µs |"
    )
    print("| ---: | --- | ---: | ---: | ---: | --- | ---: |")
    for m, name, cublas, results, summed in rows:
        n, k = SHAPES[name]
        us, cfg = results[0]
        plus = "" if summed is None else f"{summed:.1f}"
        print(f"| {m} | {name} | {cublas:.1f} | {us:.1f} | {plus} | {cfg} | {n * k / 3.35e6:.1f} |")
        print("   runners-up: " + "; ".join(f"{u:.1f} {c}" for u, c in results[1:4]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
