"""The two kernels that bound a long-context step, alone, in seconds of GPU time.

    python3 dev/bench_long_context.py                     # both parts
    python3 dev/bench_long_context.py --part decode --ctx 14000,27700
    python3 dev/bench_long_context.py --part attention --seq 16384,27700

decode: paged decode attention over 64 rows x ctx positions (the `h200-long` batch at a 27,648-token
budget), Qwen2-1.5B's heads (12 query, 2 KV, dim 128), 16-token pages in shuffled order, for a
bf16 and an fp8 (e4m3) cache: each launch setting's median time and effective bandwidth (the
KV bytes the rows attend to, read once), after a check against the gathered SDPA reference.
attention: dense causal attention of one sequence (the update's micro-batch at long context),
forward and forward + backward, per kernel, in TFLOP/s (causal: 2·2·H·D·s²/2 forward, 2.5x that
backward) with the error against float32 SDPA on a slice.
The device's copy bandwidth is measured first: the ceiling the decode figures are read against.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
import triton.testing
from cuda_timing import cuda_ms

from minirl_plugins.engines.native.layers import paged_attention as pa
from minirl_plugins.engines.native.layers.meta import Heads, StepMeta

HEADS = Heads(12, 2, 128)
FLEX = False  # flex attention measured 369 / 345 TFLOP/s at 27.7k (below cuDNN): off, it compiles for a minute
PAGE = 16


def copy_bandwidth() -> float:
    """TB/s of a 4 GiB device-to-device copy (bytes read + written)."""
    src = torch.empty(1 << 31, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = cuda_ms(lambda: dst.copy_(src), reps=10)
    return 2 * (1 << 32) / ms / 1e9


def paged_case(rows: int, ctx: int, kv_dtype: torch.dtype, seed: int = 0):
    """rows decode rows at ctx positions each, their pages shuffled over the cache."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    h, hk, d = HEADS
    pages = -(-ctx // PAGE)
    perm = torch.randperm(rows * pages, device="cuda", generator=gen) + 1
    slots = (rows * pages + 1) * PAGE
    kc = torch.randn(slots, hk, d, device="cuda", generator=gen).to(kv_dtype)
    vc = torch.randn(slots, hk, d, device="cuda", generator=gen).to(kv_dtype)
    qkv = torch.randn(rows, (h + 2 * hk) * d, device="cuda", generator=gen, dtype=torch.bfloat16)
    meta = StepMeta(
        False,
        torch.zeros(rows, dtype=torch.long, device="cuda"),
        kv_cache=kc,
        rows_B=torch.arange(rows, device="cuda"),
        ctx_lens_B=torch.full((rows,), ctx, dtype=torch.int32, device="cuda"),
        page_table=perm.view(rows, pages).to(torch.int32),
        page_size=PAGE,
        max_ctx=ctx,
        split_counts=torch.zeros(rows, dtype=torch.int32, device="cuda"),
    )
    return qkv, kc, vc, meta


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).norm() / ref.float().norm())


DECODE_LAUNCHES = (  # block_n, warps, stages
    (32, 4, 3),
    (64, 4, 3),
    (128, 4, 3),
    (128, 8, 2),
    (64, 4, 1),
    (128, 4, 1),
    (128, 8, 1),
)


KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def decode_part(
    rows: int, contexts: list[int], splits_list: list[int], kv_names: list[str], launches=DECODE_LAUNCHES
) -> list[str]:
    lines = ["| kv | ctx | splits | block_n | warps | stages | f16 | us | TB/s | rel err |"]
    lines.append("|---" * 10 + "|")
    best = {}
    for kv_dtype in (KV_DTYPES[name] for name in kv_names):
        fp8 = kv_dtype.itemsize == 1
        for ctx in contexts:
            qkv, kc, vc, meta = paged_case(rows, ctx, kv_dtype)
            kv_bytes = 2 * rows * ctx * HEADS.num_kv_heads * HEADS.head_dim * kv_dtype.itemsize
            ref = pa.decode_attention(qkv, kc, vc, meta, HEADS, 128**-0.5)
            default_splits = pa.num_splits(rows, HEADS.num_kv_heads, qkv.device)
            for splits in [default_splits] + [s for s in splits_list if s != default_splits]:
                meta.num_splits = splits
                for block_n, warps, stages in launches:
                    for f16 in (True, False) if fp8 else (False,):
                        if fp8 and not f16 and block_n != 64:
                            continue
                        cfg = dict(block_n=block_n, num_warps=warps, num_stages=stages, fp8_f16=f16)
                        case = (qkv, kc, vc, meta, HEADS, 128**-0.5)
                        fn = lambda cfg=cfg, case=case: pa.decode_attention_triton(*case, config=cfg)
                        try:
                            err = rel_err(fn(), ref)
                            us = triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median") * 1e3
                        except Exception as exc:  # resources: report and go on
                            lines.append(f"| {kv_dtype} {ctx} {splits} {cfg} failed: {type(exc).__name__} |")
                            continue
                        tbs = kv_bytes / us / 1e6
                        name = "fp8" if fp8 else "bf16"
                        lines.append(
                            f"| {name} | {ctx} | {splits} | {block_n} | {warps} | {stages} | {f16} "
                            f"| {us:.1f} | {tbs:.2f} | {err:.1e} |"
                        )
                        if err < 3e-2 and tbs > best.get((name, ctx), (0,))[0]:
                            best[(name, ctx)] = (tbs, us, splits, cfg)
                        print(lines[-1], flush=True)
            del qkv, kc, vc, meta, ref
            torch.cuda.empty_cache()
    lines.append("")
    lines += [f"best {k}: {v[0]:.2f} TB/s ({v[1]:.1f} us) splits={v[2]} {v[3]}" for k, v in best.items()]
    return lines


def attention_kernels():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(backend, gqa):
        def run(q, k, v):
            if not gqa:
                k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

        return run

    def aten_flash(q, k, v):  # what minirl's varlen "torch" backend runs: [N, H, D], GQA native
        n = q.shape[2]
        cu = torch.tensor([0, n], dtype=torch.int32, device=q.device)
        qn, kn, vn = (x[0].transpose(0, 1) for x in (q, k, v))
        out = torch.ops.aten._flash_attention_forward(qn, kn, vn, cu, cu, n, n, 0.0, True, False)[0]
        return out.transpose(0, 1)[None]

    kernels = {
        "aten flash (minirl now)": aten_flash,
        "sdpa flash": sdpa(SDPBackend.FLASH_ATTENTION, True),
        "sdpa cudnn gqa": sdpa(SDPBackend.CUDNN_ATTENTION, True),
        "sdpa cudnn repeat": sdpa(SDPBackend.CUDNN_ATTENTION, False),
        "sdpa efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION, True),
    }
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
        masks = {}

        def flex_run(q, k, v):
            n = q.shape[2]
            if n not in masks:
                masks[n] = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, n, n, device=q.device)
            return flex(q, k, v, block_mask=masks[n], enable_gqa=True)

        kernels["flex (compiled)"] = flex_run if FLEX else None
    except Exception as exc:
        print(f"flex attention unavailable: {exc}")
    return kernels


def first_call_ms(fn, s: int) -> tuple[float, float]:
    """Host-timed first forward, and first forward + backward, at two unseen lengths s+1, s+2
    (what a new shape costs a kernel that builds a plan per shape)."""
    import time

    h, hk, d = HEADS
    out = []
    for extra, backward in ((1, False), (2, True)):
        q, k, v = (
            torch.randn(1, x, s + extra, d, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
            for x in (h, hk, hk)
        )
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        o = fn(q, k, v)
        if backward:
            o.backward(torch.ones_like(o))
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return out[0], out[1]


def ncu_part(ctx: int) -> list[str]:
    """One launch per cache dtype to profile (run under ncu -k regex:_decode_kernel)."""
    for kv_dtype, splits, cfg in (
        (torch.float8_e4m3fn, 16, dict(block_n=128, num_warps=4, num_stages=3, fp8_f16=True)),
        (torch.bfloat16, 4, dict(block_n=64, num_warps=4, num_stages=3, fp8_f16=False)),
    ):
        qkv, kc, vc, meta = paged_case(64, ctx, kv_dtype)
        meta.num_splits = splits
        pa.decode_attention_triton(qkv, kc, vc, meta, HEADS, 128**-0.5, config=cfg)
        torch.cuda.synchronize()
    return []


def attention_part(seqs: list[int]) -> list[str]:
    h, hk, d = HEADS
    lines = ["| kernel | seq | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | out err | dq err | new shape |"]
    lines.append("|---" * 9 + "|")
    for s in seqs:
        gen = torch.Generator(device="cuda").manual_seed(s)
        q = torch.randn(1, h, s, d, device="cuda", generator=gen, dtype=torch.bfloat16)
        k = torch.randn(1, hk, s, d, device="cuda", generator=gen, dtype=torch.bfloat16)
        v = torch.randn(1, hk, s, d, device="cuda", generator=gen, dtype=torch.bfloat16)
        g = torch.randn(1, h, s, d, device="cuda", generator=gen, dtype=torch.bfloat16)
        flops = 4 * h * d * s * s / 2
        # reference: the last 1,024 queries in float32, against every key (the causal tail)
        tail = 1024
        qt = q[:, :, -tail:].float()
        kr, vr = (x.float().repeat_interleave(h // hk, dim=1) for x in (k, v))
        mask = torch.ones(tail, s, dtype=torch.bool, device="cuda").tril(s - tail)
        ref_out = F.scaled_dot_product_attention(qt, kr, vr, attn_mask=mask)
        del kr, vr
        qg = q.detach().float().requires_grad_()
        for name, fn in attention_kernels().items():
            if fn is None or name in ("sdpa flash", "sdpa efficient", "sdpa cudnn repeat"):
                continue
            row = [name, str(s)]
            try:
                out = fn(q, k, v)
                out_err = rel_err(out[:, :, -tail:], ref_out)
                t_fwd = cuda_ms(lambda fn=fn, qkv=(q, k, v): fn(*qkv), reps=5, warmup=1)
                qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))

                def fwd_bwd(fn=fn, qq=qq, kk=kk, vv=vv, g=g):
                    fn(qq, kk, vv).backward(g)

                t_all = cuda_ms(fwd_bwd, reps=5, warmup=1)
                qq.grad = None
                fwd_bwd()
                dq_tail = qq.grad[:, :, -tail:].float()
                # dq of the tail queries, float32 on the same slice
                qg.grad = None
                kr, vr = (x.float().repeat_interleave(h // hk, dim=1) for x in (k, v))
                F.scaled_dot_product_attention(qg[:, :, -tail:], kr, vr, attn_mask=mask).backward(
                    g[:, :, -tail:].float()
                )
                dq_err = rel_err(dq_tail, qg.grad[:, :, -tail:])
                del kr, vr
                row += [f"{t_fwd:.2f}", f"{flops / t_fwd / 1e9:.0f}"]
                row += [f"{t_all:.2f}", f"{3.5 * flops / t_all / 1e9:.0f}"]
                row += [f"{out_err:.1e}", f"{dq_err:.1e}"]
                row += ["first call ms fwd %.1f / fwd+bwd %.1f" % first_call_ms(fn, s)]
            except Exception as exc:
                row.append(f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
            lines.append("| " + " | ".join(row) + " |")
            print(lines[-1], flush=True)
        del q, k, v, g
        torch.cuda.empty_cache()
    return lines


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--part", default="decode,attention")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--ctx", default="14000,27700")
    p.add_argument("--splits", default="8,16")
    p.add_argument("--seq", default="16384,27700")
    p.add_argument("--kv", default="bf16,fp8", help="KV cache dtypes of the decode part")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}"]
    lines.append(f"copy bandwidth {copy_bandwidth():.2f} TB/s")
    print(lines[-1], flush=True)
    if "decode" in args.part:
        contexts, splits = [int(c) for c in args.ctx.split(",")], [int(s) for s in args.splits.split(",")]
        lines += decode_part(args.rows, contexts, splits, args.kv.split(","))
    if "ncu" in args.part:
        ncu_part(int(args.ctx.split(",")[-1]))
    if "attention" in args.part:
        lines += attention_part([int(s) for s in args.seq.split(",")])
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
