"""Masked statistics (docs/algorithms.md §1): numpy float64 references and the cross-rank reducer."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minirl.algo.stats import DeviceSums, masked_mean, masked_sum, masked_var, masked_whiten

FAST = settings(max_examples=30, deadline=None)


def run_ranks(fns):
    """Run fns[r](reduce_r) in one thread per simulated rank; reduce_r all-reduces (sums) its
    argument over the ranks, in rank order, exactly like a collective would."""
    world = len(fns)
    barrier = threading.Barrier(world, timeout=20)
    slots: list = [None] * world
    results: list = [None] * world
    errors: list = []

    def make_reduce(rank):
        def reduce(x):
            slots[rank] = x.clone()
            barrier.wait()
            total = sum(slots[1:], slots[0].clone())
            barrier.wait()  # nobody overwrites a slot before every rank has read it
            return total

        return reduce

    def target(rank):
        try:
            results[rank] = fns[rank](make_reduce(rank))
        except BaseException as exc:  # surface a rank's failure instead of hanging the others
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # barrier hand-offs would otherwise wait out 5 ms GIL slices
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old_interval)
    if errors:
        raise errors[0]
    return results


@st.composite
def masked_batches(draw, min_valid=2):
    """(x_BT, mask_BT) in float64 with at least `min_valid` valid entries."""
    B, T = max(draw(st.integers(1, 6)), min_valid), draw(st.integers(1, 7))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    offset, scale = draw(st.floats(-10, 10)), draw(st.floats(0.1, 10))
    x = offset + scale * torch.randn(B, T, generator=gen, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=gen) < draw(st.floats(0.2, 1.0))).double()
    flat = mask.view(-1)
    flat[: min(min_valid, flat.numel())] = 1.0  # guarantee the minimum number of valid entries
    return x, mask


@FAST
@given(masked_batches(min_valid=2))
def test_mean_var_whiten_match_numpy_float64(batch):
    """masked_mean / masked_var (unbiased) / masked_whiten must equal the textbook float64 formulas
    over the valid entries: these statistics drive every whitened advantage."""
    x, mask = batch
    xs = x.numpy()[mask.numpy() > 0]
    ref_mean = (x * mask).sum().item() / (mask.sum().item() + 1e-8)
    assert np.isclose(masked_mean(x, mask).item(), ref_mean, rtol=1e-12, atol=1e-12)
    assert np.isclose(masked_var(x, mask).item(), np.var(xs, ddof=1), rtol=1e-9, atol=1e-9)
    ref_white = (x.numpy() - xs.mean()) / np.sqrt(np.var(xs, ddof=1) + 1e-8)
    got = masked_whiten(x, mask).numpy()
    valid = mask.numpy() > 0
    np.testing.assert_allclose(got[valid], ref_white[valid], rtol=1e-6, atol=1e-5)
    assert np.all(got[~valid] == 0.0)


@settings(max_examples=15, deadline=None)  # threads: ~30 ms an example
@given(masked_batches(min_valid=1), st.integers(1, 5))
def test_whitening_across_two_ranks_equals_whitening_of_concatenation(batch, split):
    """Batch-wide whitening must be exact across data-parallel ranks: each rank whitens its rows
    with the reduce-aware statistics and the result equals whitening the concatenated batch."""
    x, mask = batch
    split = min(split, x.shape[0])
    parts = [(x[:split], mask[:split]), (x[split:], mask[split:])]
    out = run_ranks([lambda red, p=p: masked_whiten(p[0], p[1], red) for p in parts])
    torch.testing.assert_close(torch.cat(out), masked_whiten(x, mask), rtol=1e-10, atol=1e-10)
    means = run_ranks([lambda red, p=p: masked_mean(p[0], p[1], red) for p in parts])
    for m in means:
        torch.testing.assert_close(m, masked_mean(x, mask), rtol=1e-12, atol=1e-12)


@FAST
@given(masked_batches(min_valid=3))
def test_whitened_valid_entries_have_mean_zero_and_unit_variance(batch):
    """The defining property of whitening (up to the 1e-8 in the denominator), independent of the
    numpy reference above."""
    x, mask = batch
    if masked_var(x, mask).item() < 1e-3:
        return  # the 1e-8 regulariser dominates for near-constant data: not this property
    w = masked_whiten(x, mask)
    assert abs(masked_mean(w, mask).item()) < 1e-6
    assert abs(masked_var(w, mask).item() - 1.0) < 1e-4


def test_shift_mean_false_keeps_the_mean_as_verl_does():
    """verl's shift_mean=False whitens and adds the mean back: (x − μ)/σ + μ on valid entries
    (not x/σ, which an earlier version computed while claiming verl's definition)."""
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    got = masked_whiten(x, mask, shift_mean=False)
    expected = torch.tensor([[-1.0, 0.0, 1.0, 0.0]], dtype=torch.float64) / np.sqrt(1.0 + 1e-8) + 2.0
    expected[0, 3] = 0.0  # masked positions stay exactly 0
    torch.testing.assert_close(got, expected)
    assert abs(masked_mean(got, mask).item() - 2.0) < 1e-6 and abs(masked_var(got, mask).item() - 1.0) < 1e-6


def test_one_or_zero_valid_entries_give_zero_variance_not_nan():
    """Choice documented in masked_var: N <= 1 gives variance 0 (no host sync, no NaN), so a
    single valid token whitens to exactly 0 and an empty mask gives mean 0."""
    x = torch.tensor([[5.0, 7.0]])
    one = torch.tensor([[1.0, 0.0]])
    none = torch.zeros(1, 2)
    assert masked_var(x, one).item() == 0.0
    assert torch.equal(masked_whiten(x, one), torch.zeros(1, 2))
    assert masked_mean(x, none).item() == 0.0
    assert torch.equal(masked_whiten(x, none), torch.zeros(1, 2))


def test_masked_sum_reduces_once_over_ranks():
    """masked_sum sums over the mask and then over ranks (here: a reducer that doubles)."""
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    assert masked_sum(x, mask).item() == 8.0
    assert masked_sum(x, mask, reduce=lambda t: 2 * t).item() == 16.0


def test_golden_masked_var_unbiased():
    """Hand value: entries [1, 2, 3, 4] valid, 99 masked: mean 2.5, Σ(x−mean)² = 5, var = 5/3."""
    x = torch.tensor([[1.0, 2.0, 99.0], [3.0, 4.0, 99.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    assert np.isclose(masked_mean(x, mask).item(), 2.5)
    assert np.isclose(masked_var(x, mask).item(), 5.0 / 3.0)


def test_engine_metrics_split_seconds_from_counts():
    """An engine's last_stats: seconds become parts of the gen phase, GiB what the engine holds,
    counts rollout/ figures; an engine without last_stats adds nothing."""
    import types

    from minirl.dist.context import DistContext
    from minirl.observe.step_metrics import engine_metrics

    dist = DistContext(device=torch.device("cpu"))
    stats = {"kv_resume_s": 0.25, "graph_captures": 3, "preemptions": 0, "weights_gib": 1.5, "note": "not a number"}
    engine = types.SimpleNamespace(last_stats=stats)
    assert engine_metrics(engine, dist) == {
        "timing_s/gen.kv_resume": 0.25,
        "memory_gib/held/engine.weights": 1.5,
        "rollout/graph_captures": 3.0,
        "rollout/preemptions": 0.0,
    }
    assert engine_metrics(types.SimpleNamespace(), dist) == {}


@FAST
@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=20))
def test_device_sums_equal_float64_sums_read_once(values):
    """Sums of float32 contributions accumulate in float64, as the float() readings they replace
    did; `means` reduces every name in one call and divides by the count."""
    sums, calls = DeviceSums(), []

    def reduce(x):
        calls.append(x.clone())
        return 2 * x  # a second rank holding the same sums

    for v in values:
        sums.add("a", torch.tensor(v, dtype=torch.float32))
        sums.add("b", torch.tensor([[-v]], dtype=torch.float32))  # any one-element shape
    out = sums.means(4, "x/", reduce)
    expected = sum(float(torch.tensor(v, dtype=torch.float32)) for v in values)
    assert len(calls) == 1 and calls[0].dtype == torch.float64
    assert out == {
        "x/a": pytest.approx(2 * expected / 4, rel=1e-12, abs=1e-9),
        "x/b": pytest.approx(-2 * expected / 4, rel=1e-12, abs=1e-9),
    }
    assert DeviceSums().means(3, "x/", reduce) == {} and len(calls) == 1
