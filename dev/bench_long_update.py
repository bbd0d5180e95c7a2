"""One long-sequence micro-batch of the update, alone: forward + backward of a packed
prompt + response through Qwen2-1.5B's shape (random weights, fp32 master weights under bf16
autocast, compiled layers, the chunked log-prob head), per attention kernel and per number of
recomputed layers.

    python3 dev/bench_long_update.py                       # 27,700 tokens, the default variants
    python3 dev/bench_long_update.py --tokens 16484 --variants 28:0,28:4096,14:4096

A variant is `recomputed_layers:long_sequence`: the first `recomputed_layers` decoder layers run
under activation checkpointing (28: all, today's `h200-long`), and `long_sequence` is
minirl.models.varlen.LONG_SEQUENCE (0: the flash kernel at every length; 4096: cuDNN for
sequences of 4,096 tokens or more). Printed: the median of 3 timed forward + backward passes,
the forward alone without gradients (the reference pass), the peak memory, and the MFU of the
update by minirl's own count (6·N·tokens + attention, observe/metrics.train_flops) over 989
TFLOP/s. A variant that runs out of memory is reported as such.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minirl.forward.packed import logprob_head, packed_forward
from minirl.models import varlen
from minirl.models.compile import compile_layers
from minirl.models.loading import random_model
from minirl.models.presets import preset_config
from minirl.observe.metrics import flops_params, train_flops

PEAK = 989e12


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=27_700)
    p.add_argument("--prompt", type=int, default=100)
    p.add_argument("--variants", default="28:0,28:4096,14:4096,7:4096,0:4096")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--preset", default="qwen2-1.5b")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    device = torch.device(args.device)
    # bf16 parameters, as FSDP2 gathers them for the forward (param_dtype): the activations are bf16
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(preset_config(args.preset), device, dtype, 0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    compile_layers(model, device.type == "cuda")
    layers = model.get_decoder().layers
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (args.prompt,), generator=gen).tolist()
    response = torch.randint(0, vocab, (args.tokens - args.prompt,), generator=gen).tolist()
    head = logprob_head(1.0)
    n = flops_params(model)
    flops = train_flops(model.config, n, [args.tokens], backward=True)
    fwd_flops = train_flops(model.config, n, [args.tokens], backward=False)

    def step():
        logp, _ = packed_forward(model, [prompt], [response], device, head)
        logp.sum().backward()

    def forward_only():
        with torch.no_grad():
            packed_forward(model, [prompt], [response], device, head)

    rows = []
    for variant in args.variants.split(","):
        recomputed, long_seq = (int(x) for x in variant.split(":"))
        varlen.LONG_SEQUENCE = long_seq
        for i, layer in enumerate(layers):
            layer.gradient_checkpointing = i < recomputed
        model.zero_grad(set_to_none=True)
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.empty_cache()
        try:
            step()  # warm-up (compiles on the first variant)
            model.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            t = timed(step, args.reps)
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
            t_fwd = timed(forward_only, args.reps)
            row = (
                f"| {recomputed} | {long_seq} | {t * 1e3:.0f} | {100 * flops / t / PEAK:.1f}% | {peak:.1f} "
                f"| {t_fwd * 1e3:.0f} | {100 * fwd_flops / t_fwd / PEAK:.1f}% |"
            )
        except torch.OutOfMemoryError:
            row = f"| {recomputed} | {long_seq} | out of memory | | | | |"
        model.zero_grad(set_to_none=True)
        print(row, flush=True)
        rows.append(row)
    print(f"\n{args.tokens} tokens (prompt {args.prompt}), {n / 1e9:.2f}B FLOP-counted parameters")
    print("| recomputed layers | LONG_SEQUENCE | fwd+bwd ms | MFU | peak GiB | fwd (no grad) ms | fwd MFU |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
