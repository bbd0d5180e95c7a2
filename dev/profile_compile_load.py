"""Where step 1's "loading" goes: the compiled layers' graphs taken from inductor's cache by a process
that did not compile them (what the trainer does after minirl.precompile's twin), under cProfile.

    python3 dev/profile_compile_load.py                                  # h200-long, 28k tokens
    python3 dev/profile_compile_load.py --profile h200-long data.max_response_length=27648
    python3 dev/profile_compile_load.py --profile cpu --top 25           # CPU smoke run

Three processes over one fresh cache folder, each running the twin's passes (run_twin: the
gradient-free passes, then the update's forward and backward, the trainer's micro-batch size) on
the run's own config: the first compiles (cold), the second and third find every graph in the
cache (warm), the third under cProfile. Printed: each process's wall time and dynamo's account
(compile/seconds, graphs, cache hits and misses), then the profile's functions by cumulative time
and a split of the warm compile by the library that spent it (dynamo's bytecode tracing,
AOTAutograd, inductor's cache, Triton's loading, the passes' own kernels).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time

# (file, function) whose cumulative time is each part of the warm compile
COMPILE = ("torch/_dynamo/convert_frame.py", "_compile")  # one frame's whole compile (no nesting)
BACKEND = ("torch/_dynamo/output_graph.py", "_call_user_compiler")  # AOTAutograd + inductor: the cache loads


def child(args) -> None:
    """Run the twin's passes once; print one JSON line of timings."""
    import torch

    from minirl.config.load import load_config
    from minirl.observe.metrics import compile_totals
    from minirl.precompile import NO_GRAD, UPDATE, run_twin

    cfg = load_config(args.config, args.overrides, args.profile)
    times, start = {}, time.perf_counter()

    def report(kind: str) -> None:
        times[kind] = round(time.perf_counter() - start, 2)

    before = compile_totals()
    prof = cProfile.Profile() if args.child == "profiled" else None
    if prof is not None:
        prof.enable()
    run_twin(cfg, (NO_GRAD, UPDATE), report)
    if prof is not None:
        prof.disable()
        prof.dump_stats(args.stats)
    now = compile_totals()
    seconds, graphs, hits, misses = (now[i] - before[i] for i in range(4))
    wall = time.perf_counter() - start
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    timings = dict(wall_s=round(wall, 2), passes=times, compile_s=round(seconds, 2), graphs=graphs)
    print(json.dumps(dict(timings, hits=hits, misses=misses, device=device)))


def split(stats: pstats.Stats) -> dict[str, float]:
    """The warm compile's cumulative seconds: in all, its backend's (AOTAutograd's and inductor's
    cache loads, Triton's kernels), and dynamo's own (bytecode tracing over fake tensors, guards)."""

    def cumulative(where: tuple[str, str]) -> float:
        path, func = where
        return sum(
            v[3] for (f, _, name), v in stats.stats.items() if name == func and f.replace("\\", "/").endswith(path)
        )

    total, backend = cumulative(COMPILE), cumulative(BACKEND)
    return {
        "compiling in all (dynamo's _compile)": total,
        "  the backend: AOTAutograd's and inductor's cache loads": backend,
        "  dynamo: tracing the bytecode over fake tensors, guards": total - backend,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", help="config overrides (key=value)")
    p.add_argument("--config", default="bench.toml")
    p.add_argument("--profile", default="h200-long")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--child", choices=("plain", "profiled"), help=argparse.SUPPRESS)
    p.add_argument("--stats", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return 0
    cache = tempfile.mkdtemp(prefix="minirl_load_")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"))
    stats = os.path.join(cache, "load.prof")
    base = [sys.executable, os.path.abspath(__file__), "--config", args.config, "--profile", args.profile]
    base += args.overrides
    for label, kind in (("cold (compiles)", "plain"), ("warm", "plain"), ("warm, profiled", "profiled")):
        out = subprocess.run([*base, "--child", kind, "--stats", stats], env=env, capture_output=True, text=True)
        line = next((x for x in reversed(out.stdout.splitlines()) if x.startswith("{")), None)
        if out.returncode or line is None:
            print(out.stdout[-3000:], out.stderr[-6000:], sep="\n")
            return 1
        print(f"{label:16} {line}", flush=True)
    st = pstats.Stats(stats)
    st.sort_stats("cumulative").print_stats(args.top)
    st.sort_stats("tottime").print_stats(args.top // 2)
    print("-- the warm, profiled process's compile (cProfile inflates it; the plain warm line is the real time)")
    for name, seconds in split(st).items():
        print(f"{name:60} {seconds:7.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
