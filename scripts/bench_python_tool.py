"""Time the python tool's start-up per call: the bubblewrap sandbox against the plain process.

    python scripts/bench_python_tool.py                 # 200 calls of each, alternating
    python scripts/bench_python_tool.py --calls 50 --concurrent 8

Each call runs `pass` through ToolSet.call_all, as the agent loop calls it, so the time is the
tool's own cost: making the sandbox (or the temporary directory), starting Python, arming the
tripwire, ending every process and cleaning up. The two modes alternate call by call, so that
load from other work on the machine falls on both alike; five calls of each warm up first.
Then --concurrent calls that each sleep 0.5 s run at once in one turn, in each mode: their wall
time shows that calls of different samples still overlap.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import warnings

from minirl.agent.parser import ToolCall
from minirl.agent.tools import ToolEntry, ToolSet
from minirl_plugins.tools.python_exec import PythonTool

MODES = ("bwrap", "process")


def one_turn(tools: ToolSet, codes: list[str]) -> float:
    """Seconds for one turn of calls, each of which must succeed."""
    start = time.perf_counter()
    outcomes = asyncio.run(tools.call_all([ToolCall("python", {"code": code}, "") for code in codes]))
    elapsed = time.perf_counter() - start
    assert all(o.status == "ok" for o in outcomes), [o.text for o in outcomes]
    return elapsed


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="timed calls per mode")
    parser.add_argument("--concurrent", type=int, default=4, help="calls in the concurrency turn")
    args = parser.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sandbox = "process" warns, as it should
        tools = {mode: ToolSet([ToolEntry.of(PythonTool({"sandbox": mode}))], max_parallel_calls=64) for mode in MODES}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for i in range(5 + args.calls):
        for mode in MODES:
            elapsed = one_turn(tools[mode], ["pass"])
            if i >= 5:
                times[mode].append(elapsed * 1000)
    print(f"start-up per call, {args.calls} calls each (ms):")
    print(f"{'mode':>8} {'p50':>7} {'p95':>7} {'mean':>7}")
    for mode in MODES:
        ms = times[mode]
        print(f"{mode:>8} {percentile(ms, 0.5):7.1f} {percentile(ms, 0.95):7.1f} {statistics.mean(ms):7.1f}")
    sleepers = ["import time\ntime.sleep(0.5)"] * args.concurrent
    for mode in MODES:
        print(f"{args.concurrent} calls sleeping 0.5 s in one turn, {mode}: {one_turn(tools[mode], sleepers):.2f} s")


if __name__ == "__main__":
    main()
