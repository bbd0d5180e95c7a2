"""Phase timers, throughput and MFU, data statistics, and the end-of-run table.

Definitions follow docs/algorithms.md §7. Every throughput says which tokens it counts.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from minirl.dist import fault

# dense bf16 FLOP/s per device, for MFU when trainer.peak_flops is 0
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "H20": 148e12, "L40S": 362e12}


def compile_totals() -> tuple[float, int, int, int]:
    """(seconds, graphs, cache hits, cache misses) of torch.compile in this process so far:
    dynamo's own account (torch._dynamo.utils, a private module: zeros where it is missing). A
    hit is a graph AOTAutograd found compiled in inductor's on-disk cache (by another process,
    e.g. minirl.precompile's twin, or an earlier run), which skips tracing its backward and
    inductor's work; a miss was compiled here."""
    try:
        from torch._dynamo import utils
    except ImportError:
        return 0.0, 0, 0, 0
    spent = getattr(utils, "calculate_time_spent", dict)()
    seconds = spent.get("total_wall_time", spent.get("entire_frame_compile", 0.0))
    counters = getattr(utils, "counters", {})
    graphs = int(counters.get("stats", {}).get("unique_graphs", 0))
    aot = counters.get("aot_autograd", {})
    return float(seconds), graphs, int(aot.get("autograd_cache_hit", 0)), int(aot.get("autograd_cache_miss", 0))


class PhaseTimer:
    """Wall-clock seconds and peak device memory of each named phase of a step, and the seconds
    the step spent compiling (compile/seconds, compile/graphs: inside the phases, mostly step 1's
    when model.compile_layers is on). Each phase is also a fault-injection point of step `step`
    (minirl.dist.fault; nothing happens unless MINIRL_FAULT names it)."""

    def __init__(self, device: torch.device, step: int | None = None):
        self.device, self.step = device, step
        self.seconds: dict[str, float] = {}
        self.peak_gib: dict[str, float] = {}
        self.compiled_before = compile_totals()

    @contextmanager
    def phase(self, name: str):
        cuda = self.device.type == "cuda"
        if cuda:  # the phase's time is its kernels' time, not the host's
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        fault.point(name, self.step)
        try:
            yield
        finally:
            if cuda:
                torch.cuda.synchronize(self.device)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            if cuda:
                self.peak_gib[name] = torch.cuda.max_memory_allocated(self.device) / 2**30

    def metrics(self) -> dict[str, float]:
        out = {f"timing_s/{k}": v for k, v in self.seconds.items()}
        out.update({f"memory_gib/{k}": v for k, v in self.peak_gib.items()})
        now, before = compile_totals(), self.compiled_before
        for i, name in enumerate(("seconds", "graphs", "cache_hits", "cache_misses")):
            out[f"compile/{name}"] = float(now[i] - before[i])
        return out


def peak_flops(device: torch.device, configured: float) -> float:
    if configured > 0:
        return configured
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), 0.0)


def train_flops(
    model_config, n_params: int, seq_lens: list[int], backward: bool, n_trained: int | None = None
) -> float:
    """6·N·tokens (2·N forward only) plus causal attention: 2·2·L·h·d·Σ s²/2 per forward pass.

    N is the non-embedding parameter count plus the output projection (docs/algorithms.md §7).
    n_trained (LoRA: the adapters' count): only those get weight gradients, so the backward's
    matrix work is 2·N (input gradients) + 2·n_trained instead of 4·N.
    """
    tokens = sum(seq_lens)
    layers = model_config.num_hidden_layers
    heads = model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    width = heads * head_dim
    attn_fwd = 2 * layers * width * sum(s * s for s in seq_lens)  # QK^T and PV, causal half of 4·L·w·s²
    mult = 3 if backward else 1
    if backward and n_trained is not None:
        return (4 * n_params + 2 * n_trained) * tokens + mult * attn_fwd
    return mult * (2 * n_params * tokens + attn_fwd)


def flops_params(model: torch.nn.Module) -> int:
    """Parameters that cost FLOPs per token: all but the input embedding (the lm_head counts)."""
    embed = model.get_input_embeddings().weight
    total = sum(p.numel() for p in model.parameters())
    head = model.get_output_embeddings().weight
    tied = head is embed
    return total - embed.numel() + (head.numel() if tied else 0)


TABLE_ROWS = (
    ("response length", "response_length/mean", "tokens", "mean model tokens per response (EOS in, tool tokens out)"),
    ("generation time", "timing_s/gen", "s", ""),
    ("prev logprob time", "timing_s/old_log_prob", "s", ""),
    ("ref logprob time", "timing_s/ref", "s", ""),
    ("values time", "timing_s/values", "s", "critic forward (gae)"),
    ("critic training time", "timing_s/update_critic", "s", "critic update (gae)"),
    ("training time", "timing_s/update_actor", "s", ""),
    ("weight sync time", "timing_s/update_weights", "s", ""),
    ("step time", "timing_s/step", "s", ""),
    ("gen throughput", "perf/gen_throughput_per_gpu", "tok/s/GPU", "response tokens generated (all batches drawn)"),
    ("prev logprob throughput", "perf/old_log_prob_throughput_per_gpu", "tok/s/GPU", "prompt+response tokens"),
    ("ref logprob throughput", "perf/ref_throughput_per_gpu", "tok/s/GPU", "prompt+response tokens"),
    ("values throughput", "perf/values_throughput_per_gpu", "tok/s/GPU", "prompt+response tokens"),
    ("step throughput", "perf/throughput", "tok/s", "prompt+response tokens, all GPUs"),
    ("actor MFU", "perf/mfu/actor", "", "6·N·tokens + attention, over peak bf16"),
)


def summary_table(history: list[dict[str, float]], first_step: int = 1, skipped: dict[str, str] | None = None) -> str:
    """The end-of-run table: each metric's mean over steps (the first step this process ran is
    warm-up); history[0] is step `first_step` (later than 1 after a resume). skipped: phase ->
    why this run has no such pass (old_log_prob: on-policy, or the rollout's log-probs); its
    rows say "skipped" and why where no step ran it."""
    rows = history[1:] if len(history) > 1 else history
    why = {k: v for p, v in (skipped or {}).items() for k in (f"timing_s/{p}", f"perf/{p}_throughput_per_gpu")}
    lines = [f"{'metric':26s} {'value':>12s}  {'unit':10s} counts", "-" * 78]
    for label, key, unit, counts in TABLE_ROWS:
        values = [r[key] for r in rows if key in r]
        if values:
            lines.append(f"{label:26s} {sum(values) / len(values):12.4g}  {unit:10s} {counts}")
        elif key in why and rows:
            lines.append(f"{label:26s} {'skipped':>12s}  {'':10s} {why[key]}")
    last = first_step + len(history) - 1
    steps = f"mean over steps {first_step + history.index(rows[0])}..{last}" if rows else "no steps"
    warm = f"; step {first_step} excluded as warm-up" if len(rows) < len(history) else ""
    return "\n".join(lines + [f"({steps}{warm})"])
