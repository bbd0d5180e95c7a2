"""LoRA's update against full fine-tuning, one packed micro-batch through the decoder layers of the
1.5B shape, per way of computing the LoRA layers, and the sync's merge of the adapted matrices.
Forward + backward in the trainer's dtypes: on CUDA its FSDP2 gathers every parameter in bf16 even
at one process, so the weights, activations and rotary cos/sin are bf16 and attention runs on the
flash/cuDNN kernels (minirl.models.varlen takes them for half-precision q only; float32 would time
the exact per-segment SDPA); under bf16 autocast too, for the float32-base variants. The CPU keeps
float32.

    python3 dev/bench_lora_update.py                                    # on a CUDA machine
    python3 dev/bench_lora_update.py --device cpu --preset tiny --seq-len 32 --seqs 2 --reps 1 --no-compile
    python3 dev/bench_lora_update.py --variants full,unmerged,lora --ranks 64 --reps 3 --profile
    python3 dev/bench_lora_update.py --skinny --seq-len 2048 --seqs 15 --ranks 8,64 --reps 20

Variants: `full` (every matrix trains: bf16 weights and weight gradients, as FSDP2 computes them),
`peft` (LoRA with peft's own layer forward over a float32 frozen base: what minirl ran first),
`unmerged` (lora._unmerged: x Wᵀ + b with the adapters' sum in one addmm's epilogue, over the
frozen Linears held in bf16 and every parameter bf16 as gathered: minirl's layer until
2026-12-05), `lora` (minirl's layer, lora.MergedLinear: x (W + s·B A)ᵀ with the merged weight,
one GEMM forward and one for dx, the adapters' gradients by the skinny GEMMs; an
autograd.Function, which torch.compile traces into), `op` (the same computation as a custom op
whose backward is another, both opaque to the compiler: _lora_linear_op below), `stacked`
(MergedLinear with two of the four skinny products inside the layer's own GEMMs: StackedLinear
below). Each LoRA variant at every rank of --ranks. Printed: the median forward + backward time,
its ratio to `full`, the ratio a FLOP count predicts ((4N + 2n) / 6N: no weight gradients of the
frozen matrices), the peak memory, the merge of the adapted matrices into bf16 engine buffers
(what a collocated sync does) and, with --compile-times, the first forward + backward's seconds,
compiled into empty caches. The head (final norm, lm_head, log-softmax) is left out: it is
frozen in both and its cost is the same.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import tempfile
import time
import types

import torch
from bench_long_context import copy_bandwidth  # this script's folder is on sys.path
from cuda_timing import median_ms  # dev/'s shared timer

from minirl.config.load import load_config
from minirl.models import assembly, lora
from minirl.models.attention import packed_forward_kwargs
from minirl.models.compile import compile_layers
from minirl.models.loading import random_model
from minirl.models.presets import preset_config

VARIANTS = ("full", "peft", "unmerged", "lora", "op", "stacked")
GATHERED = ("full", "unmerged", "lora", "op", "stacked")  # every parameter in compute_dtype, as FSDP2 gathers it


def compute_dtype(device: torch.device) -> torch.dtype:
    """What the trainer's layers compute in: bf16 on CUDA (FSDP2's param_dtype), float32 on the CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def build(args, variant: str, rank: int, device: torch.device):
    config = preset_config(args.preset, num_hidden_layers=args.layers)
    model = random_model(config, device, torch.float32, seed=0)
    if variant != "full":
        cfg = load_config(None, [f"model.lora_rank={rank}", f"model.lora_alpha={2 * rank}"]).model
        lora.apply_lora(model, cfg, args.preset)
        with torch.no_grad():  # trained adapters (fresh B is zero)
            for name, p in model.named_parameters():
                if lora.is_adapter_param(name):
                    p.normal_(0.0, 0.02)
        if variant == "peft":
            for layer in lora.lora_layers(model).values():
                layer.__dict__.pop("forward")  # peft's own forward
        if variant == "unmerged":
            for layer in lora.lora_layers(model).values():
                layer.forward = types.MethodType(lora._unmerged, layer)
        if variant in ("op", "stacked"):
            forward = _op_forward if variant == "op" else _stacked_forward
            for layer in lora.lora_layers(model).values():
                layer.forward = types.MethodType(forward, layer)
        if variant in ("unmerged", "lora", "op", "stacked"):
            lora.hold_frozen_in(model, torch.bfloat16)
    if variant in GATHERED:  # the parameters only: the rotary inv_freq buffer stays float32, as under FSDP2
        for p in model.parameters():
            p.data = p.data.to(compute_dtype(device))
    compile_layers(model, args.compile)
    return model


def _stacked_forward(self, x: torch.Tensor) -> torch.Tensor:
    a, b = self.lora_A[lora.ADAPTER].weight, self.lora_B[lora.ADAPTER].weight
    return StackedLinear.apply(x, self.base_layer.weight, self.base_layer.bias, a, b, self.scaling[lora.ADAPTER])


def _op_forward(self, x: torch.Tensor) -> torch.Tensor:
    base = self.base_layer
    a, b = self.lora_A[lora.ADAPTER].weight, self.lora_B[lora.ADAPTER].weight
    return torch.ops.minirl_dev.lora_linear(
        x, base.weight, base.bias, a, b, self.scaling[lora.ADAPTER], lora._matmul_dtype(x, base.weight)
    )


@torch.library.custom_op("minirl_dev::lora_linear", mutates_args=())
def _lora_linear_op(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    a: torch.Tensor,
    b: torch.Tensor,
    s: float,
    dt: torch.dtype,
) -> torch.Tensor:
    """lora.MergedLinear's forward as an op of its own (the `op` variant): torch.compile traces one
    call and inductor gets one node, where it traces into the autograd.Function's forward and
    backward and lowers their matmuls and casts. Cheaper to compile (docs/benchmarks.md, "LoRA"),
    slower to run in the trainer."""
    with torch.autocast(x.device.type, enabled=False):
        return torch.nn.functional.linear(x.to(dt), lora._merge(w, a, b, s, dt), None if bias is None else bias.to(dt))


@_lora_linear_op.register_fake
def _(x, w, bias, a, b, s, dt):
    return x.new_empty((*x.shape[:-1], w.shape[0]), dtype=dt)


@torch.library.custom_op("minirl_dev::lora_linear_backward", mutates_args=())
def _lora_linear_backward_op(
    dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, s: float, dt: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx, dA and dB: lora.MergedLinear's backward itself, on its saved state."""
    ctx = types.SimpleNamespace(
        saved_tensors=(x, w, a, b),
        s=s,
        dt=dt,
        bias_dtype=None,
        needs_input_grad=(True, False, False, True, True, False),
    )
    dx, _, _, da, db, _ = lora.MergedLinear.backward(ctx, dy)
    return dx, da, db


@_lora_linear_backward_op.register_fake
def _(dy, x, w, a, b, s, dt):
    return torch.empty_like(x), torch.empty_like(a), torch.empty_like(b)


def _op_setup(ctx, inputs, output) -> None:
    x, w, _, a, b, s, dt = inputs
    ctx.save_for_backward(x, w, a, b)
    ctx.s, ctx.dt = s, dt


def _op_grads(ctx, dy):
    x, w, a, b = ctx.saved_tensors
    dx, da, db = torch.ops.minirl_dev.lora_linear_backward(dy, x, w, a, b, ctx.s, ctx.dt)
    return dx, None, None, da, db, None, None


_lora_linear_op.register_autograd(_op_grads, setup_context=_op_setup)


class StackedLinear(torch.autograd.Function):
    """lora.MergedLinear with the adapters' skinny GEMMs folded into the layer's own: the forward
    multiplies x by [W + s·B A; s·A] (out + r rows), which gives y and s·x Aᵀ (kept for dB) in one
    read of x; the backward multiplies dy by [W + s·B A, s·B] (in + r columns), which gives dx and
    s·dy B (for dA) in one read of dy. Left: dA = (s·dy B)ᵀ x and dB = dyᵀ (s·x Aᵀ), one read of x
    and one of dy, where MergedLinear reads each twice. y and dx are views of the wider outputs.
    The same results as MergedLinear's (bit for bit on the CPU under bf16 autocast, s = 2); on one
    H100 it saved under 1% of a micro-batch's forward + backward (docs/benchmarks.md, "LoRA")."""

    @staticmethod
    def forward(ctx, x, w, bias, a, b, s: float):
        dt = lora._matmul_dtype(x, w)
        out, r = w.shape[0], a.shape[0]
        with torch.autocast(x.device.type, enabled=False):
            stacked = torch.cat([lora._merge(w, a, b, s, dt), a.to(dt) * s])
            bias_r = None if bias is None else torch.cat([bias.to(dt), bias.new_zeros(r, dtype=dt)])
            y_all = torch.nn.functional.linear(x.to(dt), stacked, bias_r)
        xa = y_all[..., out:].clone()  # s·x Aᵀ alone: y_all's storage goes with y
        ctx.save_for_backward(x, w, a, b, xa)
        ctx.s, ctx.dt = s, dt
        return y_all[..., :out]

    @staticmethod
    def backward(ctx, dy):
        x, w, a, b, xa = ctx.saved_tensors
        s, dt = ctx.s, ctx.dt
        k = w.shape[1]
        with torch.autocast(dy.device.type, enabled=False):
            dy_M = dy.reshape(-1, dy.shape[-1]).to(dt)
            x_M = x.reshape(-1, k).to(dt)
            g = dy_M @ torch.cat([lora._merge(w, a, b, s, dt), b.to(dt) * s], dim=1)
            dx = g[:, :k].view(x.shape).to(x.dtype)
            da = (g[:, k:].t() @ x_M).to(a.dtype)
            db = (dy_M.t() @ xa.reshape(-1, xa.shape[-1])).to(b.dtype)
        return dx, None, None, da, db, None


def step_fn(model, args, device: torch.device):
    """forward + backward of seq_len x seqs packed tokens through the decoder layers."""
    kwargs = packed_forward_kwargs([args.seq_len] * args.seqs, device=device)
    n = args.seq_len * args.seqs
    decoder = model.get_decoder()
    hidden = torch.randn(1, n, model.config.hidden_size, device=device, dtype=compute_dtype(device)) * 0.5
    cos_sin = decoder.rotary_emb(hidden, kwargs["position_ids"])
    kwargs = dict(kwargs, position_embeddings=cos_sin)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    def run():
        model.zero_grad(set_to_none=True)
        with autocast:
            h = hidden
            for layer in decoder.layers:
                out = layer(h, **kwargs)
                h = out[0] if isinstance(out, tuple) else out
            loss = h.float().pow(2).mean()
        loss.backward()

    return run


def first_call_s(run, device: torch.device) -> float:
    """Seconds of run()'s first call with inductor's and Triton's caches empty (a directory of its
    own, the in-process caches cleared): compiling it cold, as step 1 of a fresh machine does."""
    from torch._inductor.utils import clear_caches

    directory = tempfile.mkdtemp(prefix="bench_lora_cold_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = directory
    os.environ["TRITON_CACHE_DIR"] = os.path.join(directory, "triton")
    clear_caches()
    start = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def merge_ms(model, reps: int, device: torch.device) -> float:
    """The collocated sync's merge: every adapted matrix, merged, copied into a bf16 engine buffer."""
    merged = assembly.full_weights(model, adapted_only=True)
    # fresh bf16 buffers, whatever dtype the merge gives (bf16 or float32 adapters)
    buffers = {name: torch.empty_like(t, dtype=torch.bfloat16) for name, t in merged}

    def run():
        with torch.no_grad():
            for name, t in assembly.full_weights(model, adapted_only=True):
                buffers[name].copy_(t)

    return median_ms(run, device, reps)


def print_kernels(run, label: str, top: int = 12) -> None:
    """One more forward + backward under torch.profiler: its slowest ops by device time and, on
    CUDA, its kernel time by kind with the top kernels (scripts/profile_update.py's report)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - start
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    print(f"\n{label}: the slowest {top} ops")
    print(prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=60))
    if cuda:
        scripts = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "scripts")
        if scripts not in sys.path:
            sys.path.insert(0, scripts)
        import profile_update  # scripts/ is not a package

        print(f"\n{label}: kernel time by kind\n{profile_update.report(prof, wall)}")


def adapted_shapes(preset: str) -> dict[str, tuple[int, int]]:
    """(in, out) of one decoder layer's adapted matrices (all-linear), from the preset's config."""
    c = preset_config(preset)
    h, kv = c.hidden_size, c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    mlp = c.intermediate_size
    return {"q": (h, h), "k": (h, kv), "v": (h, kv), "o": (h, h), "gate": (h, mlp), "up": (h, mlp), "down": (mlp, h)}


def skinny_table(preset: str, tokens: int, ranks: list[int], reps: int, device: torch.device) -> None:
    """Each of the adapters' four gradient products alone, per matrix of a layer, bf16: x Aᵀ
    [M, in]·[in, r], dy B [M, out]·[out, r], (dy B)ᵀ x [r, M]·[M, in] (dA) and dyᵀ (x Aᵀ)
    [out, M]·[M, r] (dB), with the bytes each must move (its operands read once, its output
    written once), the bandwidth that makes, and the copy bandwidth measured in the same process
    (CUDA only: bench_long_context.copy_bandwidth)."""
    dt = torch.bfloat16
    copy_tbs = copy_bandwidth() if device.type == "cuda" else float("nan")
    print(f"\nthe adapters' gradient products, {tokens} tokens, bf16; copy bandwidth {copy_tbs:.2f} TB/s")
    print(f"{'matrix':6} {'r':>3} {'product':8} {'us':>8} {'MB':>8} {'TB/s':>6} {'of copy':>8}")
    totals = {}
    for rank in ranks:
        for name, (d_in, d_out) in adapted_shapes(preset).items():
            x = torch.randn(tokens, d_in, device=device, dtype=dt)
            dy = torch.randn(tokens, d_out, device=device, dtype=dt)
            a = torch.randn(rank, d_in, device=device, dtype=dt)
            b = torch.randn(d_out, rank, device=device, dtype=dt)
            xa, dyb = x @ a.t(), dy @ b
            products = {  # label: (left operand, right operand, what the product moves)
                "x A^T": (x, a.t(), (x, a, xa)),
                "dy B": (dy, b, (dy, b, dyb)),
                "dA": (dyb.t(), x, (dyb, x, a)),
                "dB": (dy.t(), xa, (dy, xa, b)),
            }
            for label, (left, right, tensors) in products.items():
                us = median_ms(functools.partial(torch.matmul, left, right), device, reps) * 1e3
                mb = sum(t.numel() * t.element_size() for t in tensors) / 1e6
                tbs = mb / us  # MB per µs is TB/s
                totals[rank] = totals.get(rank, 0.0) + us
                print(f"{name:6} {rank:3} {label:8} {us:8.1f} {mb:8.1f} {tbs:6.2f} {tbs / copy_tbs:8.0%}")
    for rank, us in totals.items():
        print(f"rank {rank}: a layer's 28 products {us:.0f} us")


def flops_ratio(model) -> float:
    """(4N + 2n) / 6N over the decoder layers: N their parameters (base and adapters), n the adapters'."""
    params = list(model.get_decoder().layers.named_parameters())
    n_all = sum(p.numel() for _, p in params)
    n_lora = sum(p.numel() for name, p in params if lora.is_adapter_param(name))
    return (4 * n_all + 2 * n_lora) / (6 * n_all)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="qwen2-1.5b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--ranks", default="8,64")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument(
        "--profile", action="store_true", help="also print each variant's slowest kernels and its kernel time by kind"
    )
    parser.add_argument(
        "--compile-times", action="store_true", help="time each variant's first call, compiling into empty caches"
    )
    parser.add_argument("--skinny", action="store_true", help="only time the adapters' gradient products alone")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.skinny:
        skinny_table(args.preset, args.seq_len * args.seqs, [int(r) for r in args.ranks.split(",")], args.reps, device)
        return
    rows = []
    full_ms = None
    for variant in args.variants.split(","):
        for rank in [0] if variant == "full" else [int(r) for r in args.ranks.split(",")]:
            torch._dynamo.reset()
            model = build(args, variant, rank, device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            run = step_fn(model, args, device)
            first = first_call_s(run, device) if args.compile_times else float("nan")
            ms = median_ms(run, device, args.reps)
            if args.profile:
                print_kernels(step_fn(model, args, device), f"{variant} r{rank}" if variant != "full" else variant)
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
            if variant == "full":
                full_ms = ms
                rows.append((variant, "-", ms, 1.0, 1.0, peak, float("nan"), first))
            else:
                ratio = ms / full_ms if full_ms else float("nan")
                rows.append(
                    (variant, rank, ms, ratio, flops_ratio(model), peak, merge_ms(model, args.reps, device), first)
                )
            del model
            with contextlib.suppress(Exception):
                torch.cuda.empty_cache()
    tokens = args.seq_len * args.seqs
    print(f"\n{args.layers} decoder layers of {args.preset}, {tokens} packed tokens, compile={args.compile}")
    head = ("variant", "rank", "fwd+bwd ms", "/ full", "FLOP ratio", "peak GiB", "merge ms", "first s")
    print(f"{head[0]:12} {head[1]:>4} {head[2]:>11} {head[3]:>7} {head[4]:>10} {head[5]:>9} {head[6]:>9} {head[7]:>8}")
    for variant, rank, ms, ratio, fr, peak, merge, first in rows:
        print(f"{variant:12} {rank!s:>4} {ms:11.2f} {ratio:7.3f} {fr:10.3f} {peak:9.2f} {merge:9.2f} {first:8.2f}")


if __name__ == "__main__":
    main()
