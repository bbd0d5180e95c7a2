"""torch.profiler over one pass of a trainer phase of a real run, on one GPU.

    python3 scripts/profile_update.py --config bench.toml --profile h200 data.train_batch_size=32 \
        rollout.n=8 actor.ppo_mini_batch_size=32 trainer.total_training_steps=2

The run goes as `python -m minirl` would (in this process, world 1). PROFILE_PHASES (default
"update") names the Trainer methods to profile: `update` (the actor's training phase) and/or
`log_probs` (a log-prob pass: the reference's, or the prev-log-prob pass too when it runs). The
PROFILE_STEP-th call of each (default 2: step 1 is warm-up) runs under the profiler. Printed, and
written to $OUT/profile_<method>.txt: the pass's wall time, the GPU kernel time by kind (GEMMs,
attention, the log-softmax/cross-entropy, element-wise, the optimizer, copies, collectives) and
the top kernels by time, and where the device idled (scripts/trace_gaps.py; PROFILE_STACK=0 drops
the Python frames it blames gaps on). The profiled step's own phase times include the profiler's
bookkeeping: time the phases from a run without this script.
"""

from __future__ import annotations

import os
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from minirl import trainer as trainer_mod
from minirl.cli import build_parser, resolve
from minirl.dist import spmd
from minirl.dist.spmd import free_port
from minirl.validate.core import validate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trace_gaps  # noqa: E402  (scripts/ is not a package)

# kernel kind: substrings of the kernel name (lower case), first match wins
KINDS = (
    ("collectives (NCCL)", ("nccl",)),
    ("optimizer (AdamW)", ("adam", "multi_tensor_apply")),
    ("attention", ("flash", "fmha", "attention", "attn", "cudnn")),
    ("fused log-prob/entropy (minirl.kernels.logprob)", ("_fwd_kernel", "_bwd_kernel")),
    ("inductor-fused element-wise (compiled layers)", ("triton_poi", "triton_red", "triton_per")),
    ("GEMM with SiLU·mul epilogue (model.fused_mlp)", ("gate_up_silu",)),
    ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "wgmma", "sm90_")),
    ("log-softmax / cross-entropy / reductions", ("softmax", "logsumexp", "reduce_kernel", "nll", "gather", "scatter")),
    ("copies / casts", ("copy", "memcpy", "memset", "cat", "convert")),
    ("element-wise", ("elementwise", "vectorized", "unrolled", "pointwise", "triton_", "silu", "mul", "add")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def report(prof, wall_s: float) -> str:
    kernels = [
        e
        for e in prof.key_averages()
        if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    ]  # GPU-side annotations (FSDP::post_backward_reduce) span kernels already counted
    total_us = sum(e.self_device_time_total for e in kernels) or 1e-9  # 0 on a CPU dry run
    by_kind: dict[str, float] = defaultdict(float)
    for e in kernels:
        by_kind[kind_of(e.key)] += e.self_device_time_total
    lines = [
        f"wall time under the profiler: {wall_s:.2f} s; GPU kernel time: {total_us / 1e6:.2f} s "
        f"({100 * total_us / 1e6 / wall_s:.0f}% of wall)",
        "",
        "| kind | GPU s | share of kernel time |",
        "| --- | ---: | ---: |",
    ]
    for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {kind} | {us / 1e6:.2f} | {100 * us / total_us:.1f}% |")
    lines += ["", "| kernel | kind | calls | GPU ms | share |", "| --- | --- | ---: | ---: | ---: |"]
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:40]:
        name = e.key if len(e.key) <= 110 else e.key[:107] + "..."
        lines.append(
            f"| `{name}` | {kind_of(e.key)} | {e.count} | {e.self_device_time_total / 1e3:.1f} | "
            f"{100 * e.self_device_time_total / total_us:.1f}% |"
        )
    return "\n".join(lines)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def patch_phase(method: str, profile_step: int, out_path: str) -> None:
    original = getattr(trainer_mod.Trainer, method)
    calls = {"n": 0}

    def profiled(self, *args):
        calls["n"] += 1
        if calls["n"] != profile_step:
            return original(self, *args)
        sync()
        start = time.perf_counter()
        stack = os.environ.get("PROFILE_STACK", "1") == "1"
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=stack) as prof:
            with record_function(f"minirl/{method}"):
                result = original(self, *args)
                sync()
        text = f"## {method}, call {profile_step}\n\n" + report(prof, time.perf_counter() - start)
        trace = os.path.join(os.environ.get("TRACE_DIR", "/tmp"), f"trace_{method}.json")
        prof.export_chrome_trace(trace)
        idle = trace_gaps.analyse(trace_gaps.load_events(trace), f"minirl/{method}")
        text += "\n\n### Device idle\n\n" + idle.table()
        print(text, flush=True)
        with open(out_path, "w") as f:
            f.write(text + "\n")
        return result

    setattr(trainer_mod.Trainer, method, profiled)


def main(argv: list[str]) -> None:
    args = build_parser().parse_intermixed_args(argv)
    pm, cfg = resolve(args)
    validate(cfg, pm)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    out_dir = os.environ.get("OUT", ".")
    for method in os.environ.get("PROFILE_PHASES", "update").split():
        patch_phase(method, int(os.environ.get("PROFILE_STEP", "2")), os.path.join(out_dir, f"profile_{method}.txt"))
    dist = spmd.init_from_env(cfg)
    try:
        trainer_mod.Trainer(cfg, pm, dist).fit()
    finally:
        spmd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
