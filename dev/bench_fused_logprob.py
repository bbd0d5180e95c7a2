"""Micro-benchmark on CUDA: one chunk of `chunked_logprobs`, fused Triton kernels vs plain torch.

    python3 dev/bench_fused_logprob.py            # V = 151,936, H = 1536 (Qwen2-1.5B's head)
    python3 dev/bench_fused_logprob.py --no-grad  # a whole log-prob pass's head, by chunk size

For n = 1024, 2048, 4096 positions a chunk, as the actor's update runs it (bf16 autocast over an
fp32 head weight, activation checkpointing, entropy on, upstream gradients on both outputs):
  - chunk pass fwd+bwd, ms: head GEMM + statistics forward, then backward (recomputed GEMM and
    statistics, grad_z, grad_h and grad_W GEMMs), for impl = fused and plain, and the GEMMs alone
    (the same four products with a precomputed grad_z): the floor the softmax math sits on;
  - peak memory above the inputs, GiB;
  - the two kernels alone on a bf16 z [n, V], ms and effective GB/s (forward reads z once;
    backward reads z and writes grad_z), against the 4.28 TB/s copy ceiling measured on the H200,
    over a small sweep of block size and warps; the chunk passes then run with the best.
--no-grad: the head of a whole log-prob pass (the 32 x 8 x 1,024 workload's 262,144 response positions, a bf16
head as the reference holds it, no entropy) through `chunked_logprobs` at chunk sizes 2,048 to
32,768: ms, the head GEMM's share of it, and TFLOP/s against the 768 measured for bf16 matmuls.
Printed as markdown tables, and written to $OUT/bench_fused_logprob.md when OUT is set.
"""

from __future__ import annotations

import os
import sys

import torch
from cuda_timing import cuda_ms

from minirl.forward.logprob import chunked_logprobs
from minirl.kernels import logprob as lt

V, H, T = 151_936, 1536, 0.6
COPY_CEILING_GBS = 4280.0


def chunk_pass(head, h_nH, y_n, g_n, impl):
    def run():
        h = h_nH.detach().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logp, ent = chunked_logprobs(h, head, y_n, T, chunk_size=h.shape[0], with_entropy=True, impl=impl)
        ((g_n[0] * logp).sum() + (g_n[1] * ent).sum()).backward()

    return run


def gemms_only(head, h_nH, grad_z):
    def run():
        h = h_nH.detach().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            with torch.no_grad():
                head(h)  # the forward's product (the recompute below is the backward's)
            z = head(h)
        z.backward(grad_z)

    return run


def peak_gib(fn) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def chunk_table(head) -> list[str]:
    rows = [
        "| n | fused fwd+bwd ms | plain fwd+bwd ms | GEMMs alone ms | fused − GEMMs | plain − GEMMs | "
        "peak GiB fused / plain |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n in (1024, 2048, 4096):
        gen = torch.Generator(device="cuda").manual_seed(n)
        h = torch.randn(n, H, device="cuda", generator=gen)
        y = torch.randint(0, V, (n,), device="cuda", generator=gen)
        g = torch.randn(2, n, device="cuda", generator=gen)
        grad_z = torch.randn(n, V, device="cuda", dtype=torch.bfloat16, generator=gen) * 1e-4
        fused, plain = chunk_pass(head, h, y, g, "fused"), chunk_pass(head, h, y, g, "plain")
        t_f, t_p, t_g = cuda_ms(fused), cuda_ms(plain), cuda_ms(gemms_only(head, h, grad_z))
        del grad_z
        head.weight.grad = None
        m_f, m_p = peak_gib(fused), peak_gib(plain)
        head.weight.grad = None
        rows.append(
            f"| {n} | {t_f:.2f} | {t_p:.2f} | {t_g:.2f} | {t_f - t_g:.2f} | {t_p - t_g:.2f} | {m_f:.2f} / {m_p:.2f} |"
        )
    return rows


def kernel_times(n: int) -> list[tuple[str, int, int, float, int]]:
    """(kernel, block, warps, ms, bytes moved) over the sweep, for a bf16 z [n, V]."""
    gen = torch.Generator(device="cuda").manual_seed(n)
    z = (3 * torch.randn(n, V, device="cuda", generator=gen)).to(torch.bfloat16)
    y = torch.randint(0, V, (n,), device="cuda", generator=gen)
    g = torch.randn(2, n, device="cuda", generator=gen)
    nbytes = z.numel() * z.element_size()
    out = []
    for block in (2048, 4096, 8192):
        for warps in (4, 8):
            lt.FWD_BLOCK, lt.FWD_WARPS = block, warps
            out.append(("forward", block, warps, cuda_ms(lambda: lt._forward(z, y, 1 / T, True)), nbytes))
    stats = lt._forward(z, y, 1 / T, True)
    for block in (1024, 4096):
        for warps in (4, 8):
            lt.BWD_BLOCK, lt.BWD_WARPS = block, warps
            ms = cuda_ms(lambda: lt._backward(z, y, stats, 1 / T, g[0], g[1]))
            out.append(("backward", block, warps, ms, 2 * nbytes))
    return out


def kernel_table() -> list[str]:
    rows = [
        "| n | kernel | block | warps | ms | GB/s | of 4.28 TB/s |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    best: dict[tuple, float] = {}
    for n in (1024, 2048, 4096):
        for kernel, block, warps, ms, moved in kernel_times(n):
            gbs = moved / ms / 1e6
            rows.append(f"| {n} | {kernel} | {block} | {warps} | {ms:.3f} | {gbs:.0f} | {gbs / COPY_CEILING_GBS:.0%} |")
            best[(kernel, block, warps)] = best.get((kernel, block, warps), 0.0) + ms
    (_, lt.FWD_BLOCK, lt.FWD_WARPS), t_fwd = min(((k, t) for k, t in best.items() if k[0] == "forward"), key=_second)
    (_, lt.BWD_BLOCK, lt.BWD_WARPS), t_bwd = min(((k, t) for k, t in best.items() if k[0] == "backward"), key=_second)
    rows.append("")
    rows.append(f"best forward: block {lt.FWD_BLOCK}, {lt.FWD_WARPS} warps ({t_fwd:.3f} ms over the three n)")
    rows.append(f"best backward: block {lt.BWD_BLOCK}, {lt.BWD_WARPS} warps ({t_bwd:.3f} ms over the three n)")
    return rows


def no_grad_table(rows: int = 262_144) -> list[str]:
    head = torch.nn.Linear(H, V, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        head.weight.normal_(0.0, 0.02)
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    y = torch.randint(0, V, (rows,), device="cuda", generator=gen)
    flops = 2 * rows * H * V
    out = [
        f"| chunk | pass ms ({rows:,} positions) | head GEMMs alone ms | GEMM TFLOP/s | of 768 |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    with torch.no_grad():
        for n in (2048, 4096, 8192, 16384, 32768):
            t_pass = cuda_ms(lambda n=n: chunked_logprobs(h, head, y, T, chunk_size=n), reps=5)
            t_gemm = cuda_ms(lambda n=n: _head_chunks(head, h, n), reps=5)
            tflops = flops / t_gemm / 1e9
            out.append(f"| {n} | {t_pass:.1f} | {t_gemm:.1f} | {tflops:.0f} | {tflops / 768:.0%} |")
    return out


def _head_chunks(head, h, n: int) -> None:
    for i in range(0, h.shape[0], n):
        head(h[i : i + n])  # dropped at once, as the pass drops each chunk's logits


def _second(pair):
    return pair[1]


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = True
    if "--no-grad" in sys.argv[1:]:
        text = "\n".join(["# no-grad log-prob pass, bf16 head, by chunk size", "", *no_grad_table()])
        print(text, flush=True)
        return
    head = torch.nn.Linear(H, V, bias=False, device="cuda")  # fp32 master weight, as the actor holds it
    with torch.no_grad():
        head.weight.normal_(0.0, 0.02)
    out = ["# kernels alone on bf16 z [n, V]", ""]
    out += kernel_table()  # leaves the best block sizes set for the chunk pass
    out += ["", f"# chunk pass, V = {V:,}, H = {H}, T = {T}, bf16 autocast, checkpointed, entropy on", ""]
    out += chunk_table(head)
    text = "\n".join(out)
    print(text, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_fused_logprob.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
