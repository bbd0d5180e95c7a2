"""Tests of scripts/trace_gaps.py: device idle time of a profiled pass, split and blamed."""

from __future__ import annotations

import json

import pytest

from tests.scripts import import_script


@pytest.fixture(scope="module")
def trace_gaps():
    return import_script("trace_gaps")


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def _trace():
    frame = "minirl/update/actor.py(45): compute_logprobs"
    return [
        {"ph": "M", "name": "process_name", "ts": 0, "args": {"name": "python"}},
        _x("user_annotation", "minirl/log_probs", 0, 1000),
        _x("gpu_user_annotation", "minirl/log_probs", 100, 600),  # its GPU-side twin
        _x("kernel", "gemm", 100, 200, correlation=1),
        _x("kernel", "gemm", 300, 200, correlation=2),  # back to back: no gap
        _x("kernel", "silu", 600, 100, correlation=3),  # launched at 550, inside the gap before it
        _x("kernel", "gemm", 800, 100, correlation=4),  # queued at 200, the host synchronized
        _x("gpu_memcpy", "Memcpy HtoD", 905, 45, correlation=5),  # queued at 100: a 5 us gap
        _x("cuda_runtime", "cudaLaunchKernel", 90, 2, correlation=1),
        _x("cuda_runtime", "cudaLaunchKernel", 95, 2, correlation=2),
        _x("cuda_runtime", "cudaMemcpyAsync", 100, 2, correlation=5),
        _x("cuda_runtime", "cudaLaunchKernel", 200, 2, correlation=4),
        _x("cuda_runtime", "cudaLaunchKernel", 550, 3, correlation=3),
        _x("cuda_runtime", "cudaStreamSynchronize", 690, 100),
        _x("python_function", frame, 540, 20),
        _x("python_function", "torch/nn/modules/module.py(1): _call_impl", 530, 40),
        _x("cpu_op", "aten::copy_", 545, 10),
        _x("cpu_op", "autograd::engine::evaluate_function", 549, 2, tid=2),  # another thread's op
    ]


def test_idle_is_split_into_lead_gaps_and_tail(trace_gaps):
    report = trace_gaps.analyse(_trace(), "minirl/log_probs")
    assert report.pass_us == 1000
    assert report.busy_us == pytest.approx(645)
    assert (report.lead_us, report.gaps_us, report.tail_us) == (100, 205, 50)
    assert report.idle_us == pytest.approx(report.lead_us + report.gaps_us + report.tail_us)
    assert report.gap_count == 3


def test_gaps_are_blamed_on_a_blocking_call_the_launching_frame_or_the_queue(trace_gaps):
    report = trace_gaps.analyse(_trace(), "minirl/log_probs")
    assert report.blame_us == {
        "aten::copy_ in minirl/update/actor.py(45): compute_logprobs": 100,
        "cudaStreamSynchronize (blocking)": 100,
        "launched before: queue ordering": 5,
    }
    assert [(start, length) for start, length, _ in report.largest] == [(500, 100), (700, 100), (900, 5)]
    assert "compute_logprobs" in report.table()


def test_a_triton_kernel_launched_through_the_driver_is_blamed_on_its_frame(trace_gaps):
    frame = "minirl/forward/packed.py(90): _packed_logprobs"
    events = [
        _x("user_annotation", "p", 0, 100),
        _x("kernel", "gemm", 0, 10, correlation=1),
        _x("kernel", "triton_poi_fused_mul_silu_1", 40, 10, correlation=2),
        _x("cuda_runtime", "cudaLaunchKernel", 0, 1, correlation=1),
        _x("cuda_driver", "cuLaunchKernel", 35, 1, correlation=2),
        _x("python_function", frame, 20, 20),
    ]
    report = trace_gaps.analyse(events, "p")
    assert report.blame_us == {frame: 30}


def test_overlapping_kernels_count_once_and_the_trace_reads_back(trace_gaps, tmp_path):
    events = [
        _x("kernel", "a", 10, 50, correlation=1),
        _x("kernel", "b", 20, 20, correlation=2),  # inside a, on another stream
        _x("kernel", "c", 40, 40, correlation=3),  # overlaps a's end
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": [*events, {"ph": "i", "name": "marker", "ts": 0}]}))
    report = trace_gaps.analyse(trace_gaps.load_events(str(path)))
    assert (report.pass_us, report.busy_us, report.idle_us) == (70, 70, 0)


def test_a_pass_without_kernels_is_all_lead(trace_gaps):
    report = trace_gaps.analyse([_x("user_annotation", "p", 0, 30)], "p")
    assert (report.busy_us, report.lead_us, report.gap_count) == (0, 30, 0)
