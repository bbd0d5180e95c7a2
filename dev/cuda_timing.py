"""Median CUDA-event time of a callable, shared by the bench_*.py scripts of dev/.

Python puts a script's own folder on sys.path, so `from cuda_timing import cuda_ms` finds this file
when one of them runs as `python3 dev/bench_x.py`."""

from __future__ import annotations

import statistics
import time

import torch


def cuda_ms(fn, reps: int = 10, warmup: int = 2) -> float:
    """Milliseconds between two events around fn(), median of `reps` runs after `warmup`."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def median_ms(fn, device: torch.device, reps: int = 10, warmup: int = 2) -> float:
    """cuda_ms on a CUDA device; elsewhere (a CPU smoke run) the median wall time of fn()."""
    if device.type == "cuda":
        return cuda_ms(fn, reps, warmup)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
