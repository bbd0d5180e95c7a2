"""Time one compiled decoder layer of the 1.5B shape on a packed micro-batch, per variant.

    python3 dev/bench_layer.py --top 16            # on a CUDA machine
    python3 dev/bench_layer.py --seq-len 64 --seqs 3 --iters 2 --variants eager,seq_major   # CPU smoke

Variants: `eager`; `hf_rotary` / `hf_rotary_32bit` (model.compile_layers as Hugging Face writes the attention: the
rotary embedding on the [B, H, N, D] view); `seq_major` (what minirl compiles: the rotary on the
[B, N, H, D] view, minirl/models/compile.py); `seq_major_32bit` (the same with inductor's
assume_32bit_indexing, where this torch has it). Modes: a no-grad forward (log-prob passes) and
forward + backward (the update). Prints the median time of each, then each variant's slowest
kernels of one forward (torch.profiler).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from minirl.models.attention import packed_forward_kwargs
from minirl.models.compile import compile_layers
from minirl.models.loading import random_model
from minirl.models.presets import preset_config

VARIANTS = ("eager", "hf_rotary", "hf_rotary_32bit", "seq_major", "seq_major_32bit")


def build(variant: str, device: torch.device):
    config = preset_config("qwen2-1.5b")
    config.num_hidden_layers = 1
    model = random_model(config, device, torch.bfloat16, seed=0)
    compile_layers(model, variant != "eager")
    if variant.startswith("hf_rotary"):
        model.get_decoder().layers[0].self_attn.__dict__.pop("forward")
    return model


def inputs(model, seq_len: int, seqs: int, device: torch.device):
    kwargs = packed_forward_kwargs([seq_len] * seqs, device=device)
    n = seq_len * seqs
    hidden = torch.randn(1, n, model.config.hidden_size, device=device, dtype=torch.bfloat16)
    cos_sin = model.get_decoder().rotary_emb(hidden, kwargs["position_ids"])
    return hidden, dict(kwargs, position_embeddings=cos_sin)


def hidden_of(out):
    """A decoder layer returns its hidden states, or (in older transformers) a tuple of them first."""
    return out[0] if isinstance(out, tuple) else out


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, iters: int, device: torch.device) -> float:
    times = []
    for _ in range(iters):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def patch_for(variant: str):
    config = torch._inductor.config
    if variant.endswith("_32bit"):
        if not hasattr(config, "assume_32bit_indexing"):
            return None
        return config.patch(assume_32bit_indexing=True)
    return contextlib.nullcontext()


def run_variant(variant: str, args, device) -> dict | None:
    torch._dynamo.reset()
    patch = patch_for(variant)
    if patch is None:
        print(f"{variant}: this torch has no inductor assume_32bit_indexing; skipped", flush=True)
        return None
    with patch:
        model = build(variant, device)
        layer = model.get_decoder().layers[0]
        for seqs in (args.seqs - 1, args.seqs):  # two lengths: the dynamic graph, as in a run
            hidden, kwargs = inputs(model, args.seq_len, seqs, device)
            with torch.no_grad():
                layer(hidden, **kwargs)
            x = hidden.detach().requires_grad_(True)
            hidden_of(layer(x, **kwargs)).float().sum().backward()
        grad = torch.randn_like(hidden)

        def forward():
            with torch.no_grad():
                layer(hidden, **kwargs)

        def train():
            hidden_of(layer(x, **kwargs)).backward(grad)

        result = {"forward_ms": timed(forward, args.iters, device), "train_ms": timed(train, args.iters, device)}
        result["kernels"] = top_kernels(forward, device, args.top)
        if args.ops and device.type == "cuda":
            result["ops"] = top_ops(forward, device, args.top)
    return result


def top_kernels(fn, device: torch.device, k: int = 5) -> list[tuple[str, float]]:
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        fn()
        synchronize(device)
    time_of = (lambda e: e.device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    rows = [(e.key, time_of(e) / 1e3) for e in prof.key_averages() if time_of(e) > 0]
    return sorted(rows, key=lambda r: -r[1])[:k]


def top_ops(fn, device: torch.device, k: int) -> list[tuple[str, float]]:
    """The k operators (with their input shapes) whose own kernels took the most device time in
    one call of fn: which operator launched a kernel the kernel list names."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        fn()
        synchronize(device)
    events = prof.key_averages(group_by_input_shape=True)
    rows = [(f"{e.key} {e.input_shapes}", e.self_device_time_total / 1e3) for e in events]
    return sorted((r for r in rows if r[1] > 0), key=lambda r: -r[1])[:k]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--seqs", type=int, default=30, help="sequences packed in the micro-batch")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--top", type=int, default=5, help="kernels listed per variant")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--ops", action="store_true", help="also list the operators behind the kernels, with shapes")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    results = {}
    for variant in args.variants.split(","):
        results[variant] = run_variant(variant, args, device)
    tokens = args.seq_len * args.seqs
    print(f"\none decoder layer, 1.5B shape, bf16, {args.seqs} x {args.seq_len} packed tokens; median ms")
    print("| variant | forward (no grad) | forward + backward |")
    print("| --- | ---: | ---: |")
    for variant, r in results.items():
        if r:
            print(f"| {variant} | {r['forward_ms']:.3f} | {r['train_ms']:.3f} |")
    for variant, r in results.items():
        if r:
            total = sum(ms for _, ms in r["kernels"])
            print(f"\n{variant}: slowest kernels of one forward ({tokens} tokens), ms (listed: {total:.3f})")
            for name, ms in r["kernels"]:
                print(f"  {ms:8.3f}  {name[:110]}")
            for name, ms in r.get("ops", []):
                print(f"  op {ms:8.3f}  {name[:160]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
