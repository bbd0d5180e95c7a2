"""loss_agg_mode (docs/algorithms.md §6): exact over the global mini-batch for any split.

The property the section asks to prove: the summed micro-batch contributions equal the global
aggregate, value and gradient, however the sequences are split into micro-batches and ranks.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minirl.algo.loss_agg import LOSS_AGG_MODES, AggNorm, aggregate, mini_batch_norm

FAST = settings(max_examples=30, deadline=None)
MODES = sorted(LOSS_AGG_MODES)


def reference(loss_BT: torch.Tensor, mask_BT: torch.Tensor, mode: str, scale: float) -> torch.Tensor:
    """The table of docs/algorithms.md §6 over the whole batch, written independently of the module.
    Rows without a valid token are not sequences (the module's documented choice)."""
    tokens_B = mask_BT.sum(-1)
    seq_sum_B = (loss_BT * mask_BT).sum(-1)[tokens_B > 0]
    formulas = {
        "token-mean": lambda: (loss_BT * mask_BT).sum() / mask_BT.sum(),
        "seq-mean-token-sum": lambda: seq_sum_B.mean(),
        "seq-mean-token-mean": lambda: (seq_sum_B / tokens_B[tokens_B > 0]).mean(),
        "seq-mean-token-sum-norm": lambda: seq_sum_B.sum() / (seq_sum_B.numel() * scale),
    }
    return formulas[mode]()


@st.composite
def batches(draw):
    """A float64 loss leaf [B, T] and prefix masks; some rows may be empty, row 0 is not."""
    B, T = draw(st.integers(1, 10)), draw(st.integers(1, 8))
    lengths = draw(st.lists(st.integers(0, T), min_size=B, max_size=B))
    lengths[0] = max(lengths[0], 1)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    loss_BT = torch.randn(B, T, generator=gen, dtype=torch.float64).requires_grad_()
    mask_BT = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).double()
    return loss_BT, mask_BT


def _split(draw, rows: list[int]) -> list[list[int]]:
    """A random partition of `rows` (already shuffled) into consecutive non-empty pieces."""
    if len(rows) <= 1:
        return [rows] if rows else []
    cuts = sorted(draw(st.sets(st.integers(1, len(rows) - 1), max_size=len(rows) - 1)))
    bounds = [0, *cuts, len(rows)]
    return [rows[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def _micro_batch(loss_BT, mask_BT, rows):
    """The rows of one micro-batch, re-padded to its own longest response (as a collator does)."""
    mask_bT = mask_BT[rows]
    width = max(int(mask_bT.sum(-1).max()), 1)
    return loss_BT[rows][:, :width], mask_bT[:, :width]


def _global_grad(loss_BT, mask_BT, mode, scale):
    leaf = loss_BT.detach().clone().requires_grad_()
    value = reference(leaf, mask_BT, mode, scale)
    value.backward()
    return value.detach(), leaf.grad


@FAST
@given(batch=batches(), mode=st.sampled_from(MODES), scale=st.sampled_from([None, 3.0]), data=st.data())
def test_any_micro_batch_partition_gives_the_global_value_and_gradient(batch, mode, scale, data):
    """For every mode, summing aggregate() over a random partition of a shuffled batch into
    micro-batches (each padded to its own width) equals the global formula, and so does the
    gradient with respect to every per-token loss."""
    loss_BT, mask_BT = batch
    T = loss_BT.shape[1]
    rows = data.draw(st.permutations(range(loss_BT.shape[0])))
    micro = [_micro_batch(loss_BT, mask_BT, part) for part in _split(data.draw, rows)]
    norm = mini_batch_norm(mask_BT, lambda x: x, scale, T)
    total = sum(aggregate(loss, mask, mode, norm) for loss, mask in micro)
    total.backward()
    ref_value, ref_grad = _global_grad(loss_BT, mask_BT, mode, norm.scale)
    torch.testing.assert_close(total.detach(), ref_value, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(loss_BT.grad, ref_grad, rtol=1e-12, atol=1e-12)


def _local_counts(mask_BT):
    """What a rank feeds to the all-reduce, captured with a reducer that records its input."""
    seen = []
    mini_batch_norm(mask_BT, lambda x: seen.append(x) or x, None, 1)
    return seen[0]


@FAST
@given(batch=batches(), mode=st.sampled_from(MODES), data=st.data())
def test_two_rank_split_gives_the_global_value_and_gradient(batch, mode, data):
    """Simulated data parallelism: the batch is split over two ranks, each with its own random
    micro-batches; the reducer sums the counts of both ranks. The sum of every contribution of
    both ranks equals the global value, and the gradient of each rank's rows is the global one."""
    loss_BT, mask_BT = batch
    rows = data.draw(st.permutations(range(loss_BT.shape[0])))
    cut = data.draw(st.integers(0, len(rows)))
    parts = (rows[:cut], rows[cut:])
    counts = [_local_counts(mask_BT[part]) for part in parts]
    total = 0.0
    for rank, part in enumerate(parts):
        micro = [_micro_batch(loss_BT, mask_BT, p) for p in _split(data.draw, part)]
        if not micro:
            continue  # a rank with no sequence contributes nothing
        other = counts[1 - rank]
        norm = mini_batch_norm(mask_BT[part], lambda x, other=other: x + other, None, loss_BT.shape[1])
        total = total + sum(aggregate(loss, mask, mode, norm) for loss, mask in micro)
    total.backward()
    ref_value, ref_grad = _global_grad(loss_BT, mask_BT, mode, float(loss_BT.shape[1]))
    torch.testing.assert_close(total.detach(), ref_value, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(loss_BT.grad, ref_grad, rtol=1e-12, atol=1e-12)


def test_golden_values_of_each_mode():
    """Hand values on L = [[1, 2, 3], [4, 0, 0]], m = [[1, 1, 1], [1, 0, 0]], S = 4:
    token-mean 10/4 = 2.5; seq-mean-token-sum (6 + 4)/2 = 5; seq-mean-token-mean (2 + 4)/2 = 3;
    seq-mean-token-sum-norm 10/(2·4) = 1.25."""
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    norm = mini_batch_norm(mask, lambda x: x, 4.0, 3)
    assert norm == AggNorm(tokens=4.0, seqs=2.0, scale=4.0)
    expected = {
        "token-mean": 2.5,
        "seq-mean-token-sum": 5.0,
        "seq-mean-token-mean": 3.0,
        "seq-mean-token-sum-norm": 1.25,
    }
    for mode, value in expected.items():
        assert aggregate(loss, mask, mode, norm).item() == pytest.approx(value)


def test_scale_defaults_to_max_response_length_and_empty_rows_are_not_sequences():
    """S = max_response_length when loss_scale_factor is unset; a padding row (no valid token)
    must not count as a sequence, or it would dilute the seq-mean modes."""
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=torch.bool)
    norm = mini_batch_norm(mask, lambda x: x, None, 512)
    assert norm == AggNorm(tokens=2.0, seqs=1.0, scale=512.0)


def test_counts_are_one_reduce_call_in_float64():
    """mini_batch_norm must all-reduce once per mini-batch (a stacked float64 tensor, exact
    beyond 2^24 tokens), not once per micro-batch."""
    calls = []
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    mini_batch_norm(mask, lambda x: calls.append(x.clone()) or x, None, 5)
    assert len(calls) == 1 and calls[0].dtype == torch.float64 and calls[0].tolist() == [7.0, 2.0]


def test_unknown_mode_and_bad_scale_are_refused_up_front():
    """aggregate and mini_batch_norm take the mode and the scale as given: validation refuses an
    unknown actor.loss_agg_mode (naming the valid modes) and a loss_scale_factor <= 0."""
    from minirl.config.load import load_config
    from minirl.validate.values import CHOICES, RANGES, choice_problems, range_problems

    cfg = load_config(None, ["actor.loss_agg_mode=token_mean", "actor.loss_scale_factor=0.0"])
    (mode,) = [p for p in choice_problems(cfg, CHOICES) if p.key == "actor.loss_agg_mode"]
    assert mode.value == "token_mean" and all(m in mode.fix for m in MODES)
    assert [p.key for p in range_problems(cfg, RANGES)] == ["actor.loss_scale_factor"]


def test_all_masked_mini_batch_gives_zero_not_nan():
    """A mini-batch without a valid token (possible after filtering) must give loss 0, not NaN."""
    mask = torch.zeros(2, 3)
    norm = mini_batch_norm(mask, lambda x: x, None, 3)
    for mode in MODES:
        assert aggregate(torch.randn(2, 3), mask, mode, norm).item() == 0.0
