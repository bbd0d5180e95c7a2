"""Packed (varlen) causal attention on CUDA: torch's FA2 kernel against cuDNN's, one micro-batch.

    python3 dev/bench_attention.py                  # a micro-batch of the 32 x 8 x 1,024 workload: ~27k tokens
    python3 dev/bench_attention.py --tokens 60000 --response 4096

The micro-batch is sequences of a 60-200-token prompt plus a `--response`-token response packed
up to `--tokens` tokens, with Qwen2-1.5B's heads (12 query heads, 2 key/value heads, dim 128),
bf16. For each kernel: forward ms and forward + backward ms, TFLOP/s (causal: 4·H·D·Σ s(s+1)/2
forward, 2.5× that for the backward), and the largest and mean error of the output and of the
gradients against per-sequence float32 SDPA. Kernels:
- fa2: aten::_flash_attention_forward/backward with fewer key/value heads than query heads
  (what minirl's varlen attention runs without flash-attn installed);
- cudnn: aten::_cudnn_attention_forward/backward on the ragged (cu_seqlens) layout, the same GQA
  inputs; cudnn-rep: the same with keys and values repeated to 12 heads;
- cudnn-pad: the sequences padded at their ends into one [batch, heads, longest, dim] batch, through
  SDPA's cuDNN backend (causal, so a row never sees its padding; GQA) and back, the padding copies
  and autograd's backward included; cudnn-pad-rep: the same with keys and values repeated.
"first ms" is the kernel's first forward on this micro-batch's shape (cuDNN builds a plan per
shape). A kernel that raises is reported with its error instead of figures.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from cuda_timing import cuda_ms
from torch.nn.attention import SDPBackend, sdpa_kernel

from minirl.models.attention import packed_forward_kwargs
from minirl.models.varlen import repeat_kv, varlen_attention

H, K, D = 12, 2, 128
NO_BIAS = torch.empty(0, device="cuda") if torch.cuda.is_available() else None  # the op's bias is not optional


def micro_batch(tokens: int, response: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    lens = []
    while True:
        n = int(torch.randint(60, 201, (1,), generator=gen)) + response
        if sum(lens) + n > tokens:
            return lens
        lens.append(n)


def fa2(q, k, v, cu, max_len, scale):
    out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale
    )

    def backward(g):
        return torch.ops.aten._flash_attention_backward(
            g, q, k, v, out, lse, cu, cu, max_len, max_len, 0.0, True, rng, unused, scale=scale
        )

    return out, backward


def cudnn(q, k, v, cu, max_len, scale):
    res = torch.ops.aten._cudnn_attention_forward(
        q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True, False, scale=scale
    )
    out, lse, seed, offset = res[0], res[1], res[6], res[7]

    def backward(g):
        return torch.ops.aten._cudnn_attention_backward(
            g, q, k, v, out, lse, seed, offset, NO_BIAS, cu, cu, max_len, max_len, 0.0, True, scale=scale
        )

    return out, backward


def cudnn_rep(q, k, v, cu, max_len, scale):
    groups = q.shape[1] // k.shape[1]
    out, backward_rep = cudnn(q, repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1]), cu, max_len, scale)

    def backward(g):
        dq, dk, dv = backward_rep(g)
        return dq, dk.unflatten(1, (-1, groups)).sum(2), dv.unflatten(1, (-1, groups)).sum(2)

    return out, backward


def cudnn_pad(q, k, v, cu, max_len, scale, repeat=False):
    lens = cu.diff()
    seq = torch.repeat_interleave(torch.arange(len(lens), device=q.device), lens)
    pos = torch.arange(q.shape[0], device=q.device) - cu[seq]
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def pad(t):
        out = t.new_zeros(len(lens), max_len, t.shape[1], t.shape[2])
        out[seq, pos] = t
        return out.transpose(1, 2)

    qp, kp, vp = (pad(t) for t in leaves)
    if repeat:
        kp, vp = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (kp, vp))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=not repeat)
    out = o.transpose(1, 2)[seq, pos]

    def backward(g):
        return torch.autograd.grad(out, leaves, g, retain_graph=True)

    return out, backward


def cudnn_pad_rep(q, k, v, cu, max_len, scale):
    return cudnn_pad(q, k, v, cu, max_len, scale, repeat=True)


KERNELS = {"fa2": fa2, "cudnn": cudnn, "cudnn-rep": cudnn_rep, "cudnn-pad": cudnn_pad, "cudnn-pad-rep": cudnn_pad_rep}


def first_ms(kernel, *args) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    kernel(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def reference(q, k, v, g, cu, max_len, scale):
    """Per-sequence float32 SDPA (minirl's exact varlen backend): output and gradients of (out · g).sum()."""
    q, k, v = (t.float().requires_grad_() for t in (q, k, v))
    out = varlen_attention(q, k, v, cu, max_len, scale, backend="sdpa")
    (out * g.float()).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def errors(got, want) -> str:
    diff = (got.float() - want).abs()
    return f"{diff.max().item():.2e} / {diff.mean().item():.1e}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=27_500)
    parser.add_argument("--response", type=int, default=1024)
    args = parser.parse_args()
    lens = micro_batch(args.tokens, args.response)
    n, scale = sum(lens), D**-0.5
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, g = (torch.randn(n, h, D, device="cuda", generator=gen, dtype=torch.bfloat16) for h in (H, K, K, H))
    cu = packed_forward_kwargs(lens, "cuda")["cu_seq_lens_q"]
    ref = reference(q, k, v, g, cu, max(lens), scale)
    flops = 4 * H * D * sum(s * (s + 1) / 2 for s in lens)
    print(f"{len(lens)} sequences, {n} tokens, max {max(lens)}; forward {flops / 1e12:.3f} TFLOP\n")
    cols = ("kernel", "first ms", "fwd ms", "fwd TFLOP/s", "fwd+bwd ms", "fwd+bwd TFLOP/s", "out err max / mean")
    print("| " + " | ".join((*cols, "dq", "dk", "dv")) + " |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- | --- | --- | --- |")
    for name, kernel in KERNELS.items():
        row = [name]
        try:
            row.append(f"{first_ms(kernel, q, k, v, cu, max(lens), scale):.1f}")
            out, backward = kernel(q, k, v, cu, max(lens), scale)
            t_fwd = cuda_ms(lambda kernel=kernel: kernel(q, k, v, cu, max(lens), scale), reps=20, warmup=3)
            row += [f"{t_fwd:.3f}", f"{flops / t_fwd / 1e9:.0f}"]
            grads = backward(g)
            t_all = cuda_ms(lambda kernel=kernel: kernel(q, k, v, cu, max(lens), scale)[1](g), reps=20, warmup=3)
            row += [f"{t_all:.3f}", f"{3.5 * flops / t_all / 1e9:.0f}"]
            row += [errors(a, b) for a, b in zip((out, *grads), ref)]
        except Exception as e:  # report and go on: the point is which kernels run here
            if len(row) == 4:
                row += ["", "", errors(out, ref[0])]
            row.append(f"{type(e).__name__}: {str(e).splitlines()[0][:150]}")
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
