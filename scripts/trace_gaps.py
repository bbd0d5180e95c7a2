"""Where a GPU idles inside one profiled pass: a torch.profiler chrome trace read back.

    python3 scripts/trace_gaps.py trace.json [annotation]

The pass is the span of the user annotation `annotation` (scripts/profile_update.py wraps the
profiled phase in one); without it, the trace's first to last event. The device is busy while any
kernel, memcpy or memset runs. Idle time is split into:

- lead: from the pass's start to its first kernel (the host preparing the first launch);
- tail: from the last kernel's end to the pass's end (the host finishing after the device);
- gaps: idle stretches between kernels. Each gap is blamed on what the host did: a blocking CUDA
  runtime call that overlaps most of it (a synchronize, a pageable copy, a cudaFree), else, when
  the kernel that ends the gap was launched inside it (the device waited for the launch), the
  innermost Python frame (or operator) around that launch on the launching thread, else
  "launched before: queue ordering" (the kernel was queued early and waited for another stream
  or an event).

Times in the trace are microseconds.
"""

from __future__ import annotations

import bisect
import json
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
HOST_CATS = ("python_function", "cpu_op", "user_annotation")
MIN_GAP_US = 5.0  # shorter gaps are launch jitter, counted in idle but not listed


@dataclass
class GapReport:
    pass_us: float
    busy_us: float
    lead_us: float
    tail_us: float
    gaps_us: float  # all idle between kernels, the short gaps too
    listed: list[tuple[float, float, str]] = field(default_factory=list)  # gaps >= MIN_GAP_US: (start, length, blame)

    @property
    def idle_us(self) -> float:
        return self.pass_us - self.busy_us

    @property
    def gap_count(self) -> int:
        return len(self.listed)

    @property
    def largest(self) -> list[tuple[float, float, str]]:
        return sorted(self.listed, key=lambda g: -g[1])

    @property
    def blame_us(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for _, length, name in self.listed:
            out[name] += length
        return dict(out)

    @property
    def blame_count(self) -> dict[str, int]:
        return dict(Counter(name for _, _, name in self.listed))

    def table(self, top: int = 15) -> str:
        ms = 1e-3
        lines = [
            f"pass {self.pass_us * ms:.1f} ms: device busy {self.busy_us * ms:.1f} ms, idle "
            f"{self.idle_us * ms:.1f} ms = lead {self.lead_us * ms:.1f} + gaps {self.gaps_us * ms:.1f} "
            f"({self.gap_count} of >= {MIN_GAP_US:g} us, rest in shorter ones) + tail {self.tail_us * ms:.1f}",
            "",
            "| gaps blamed on | count | idle ms |",
            "| --- | ---: | ---: |",
        ]
        counts = self.blame_count
        for name, us in sorted(self.blame_us.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"| `{name}` | {counts[name]} | {us * ms:.2f} |")
        lines += ["", "| largest gaps: at ms | idle ms | blamed on |", "| ---: | ---: | --- |"]
        for start, length, name in self.largest[:top]:
            lines.append(f"| {start * ms:.2f} | {length * ms:.2f} | `{name}` |")
        return "\n".join(lines)


def load_events(path: str) -> list[dict]:
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def analyse(events: list[dict], annotation: str | None = None) -> GapReport:
    start, end = _pass_span(events, annotation)
    device = sorted(
        (e["ts"], e["ts"] + e["dur"], e.get("args", {}).get("correlation"))
        for e in events
        if e.get("cat") in DEVICE_CATS and e["ts"] < end and e["ts"] + e["dur"] > start
    )
    if not device:
        return GapReport(end - start, 0.0, end - start, 0.0, 0.0)
    launches = {  # Triton kernels launch through the driver API (cuLaunchKernel), the rest the runtime
        e["args"]["correlation"]: (e["ts"], e.get("tid"))
        for e in events
        if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})
    }
    blockers = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"])
        for e in events
        if e.get("cat") == "cuda_runtime" and _blocking(e["name"])
    )
    host = _HostStack([e for e in events if e.get("cat") in HOST_CATS and e.get("name") != annotation])
    report = GapReport(end - start, 0.0, max(0.0, device[0][0] - start), 0.0, 0.0)
    busy_end = device[0][0]
    for k_start, k_end, corr in device:
        if k_start > busy_end:
            gap = k_start - busy_end
            report.gaps_us += gap
            if gap >= MIN_GAP_US:
                name = _blame(busy_end, k_start, launches.get(corr), blockers, host)
                report.listed.append((busy_end - start, gap, name))
        report.busy_us += max(0.0, min(k_end, end) - max(k_start, busy_end, start))
        busy_end = max(busy_end, k_end)
    report.tail_us = max(0.0, end - busy_end)
    return report


def _pass_span(events: list[dict], annotation: str | None) -> tuple[float, float]:
    marks = [e for e in events if annotation and e.get("name") == annotation and e.get("cat") == "user_annotation"]
    if marks:
        return marks[0]["ts"], marks[0]["ts"] + marks[0]["dur"]
    return min(e["ts"] for e in events), max(e["ts"] + e["dur"] for e in events)


def _blocking(name: str) -> bool:
    low = name.lower()
    return any(k in low for k in ("synchronize", "memcpy", "free", "hostalloc", "malloc"))


def _blame(gap_start: float, gap_end: float, launch, blockers, host: _HostStack) -> str:
    """launch: (ts, tid) of the call that launched the kernel ending the gap, or None.
    A blocker is a runtime call that may wait (a synchronize, a memcpy, a free or malloc) and
    covers at least half the gap; an asynchronous copy from pinned memory returns in
    microseconds, so it never covers one."""
    hi = bisect.bisect_left(blockers, (gap_end,))
    for b_start, b_end, name in blockers[max(0, hi - 256) : hi]:  # a blocking call is short-lived
        if min(b_end, gap_end) - max(b_start, gap_start) >= 0.5 * (gap_end - gap_start):
            return f"{name} (blocking)"
    if launch is not None and launch[0] >= gap_start:
        return host.innermost(*launch) or "host, no frame recorded"
    return "launched before: queue ordering"


class _HostStack:
    """The host's Python frames and operators, per thread, looked up by time."""

    def __init__(self, events: list[dict]):
        by_thread: dict = defaultdict(list)
        for e in events:
            by_thread[e.get("tid")].append((e["ts"], e["ts"] + e["dur"], e["name"]))
        self.spans = {tid: sorted(spans) for tid, spans in by_thread.items()}
        self.starts = {tid: [s[0] for s in spans] for tid, spans in self.spans.items()}

    def innermost(self, ts: float, tid=None) -> str | None:
        """The shortest span on thread `tid` that contains ts, with the Python frame around it
        when that is not itself a frame."""
        spans, starts = self.spans.get(tid, []), self.starts.get(tid, [])
        hi = bisect.bisect_right(starts, ts)
        inside = [s for s in spans[max(0, hi - 5000) : hi] if s[1] >= ts]
        if not inside:
            return None
        inside.sort(key=lambda s: s[1] - s[0])
        frames = [s[2] for s in inside if ".py(" in s[2] and "torch/" not in s[2]]
        inner = inside[0][2]
        return inner if not frames or frames[0] == inner else f"{inner} in {frames[0]}"


def main(argv: list[str]) -> None:
    events = load_events(argv[0])
    print(analyse(events, argv[1] if len(argv) > 1 else None).table())


if __name__ == "__main__":
    main(sys.argv[1:])
