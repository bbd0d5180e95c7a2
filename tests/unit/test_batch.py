"""minirl.batch's scatter for the training loss: the same values and gradients as masked_scatter."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minirl.batch import response_mask, scatter_rows

LENS = st.lists(st.integers(0, 7), min_size=1, max_size=6)


def scatter_tokens(flat_N: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """The reference: masked_scatter of the values into zeros, in mask order."""
    return torch.zeros(mask_BT.shape, dtype=flat_N.dtype).masked_scatter(mask_BT.bool(), flat_N)


@settings(max_examples=60, deadline=None)
@given(LENS, st.integers(0, 3), st.integers(0, 2**31 - 1))
def test_scatter_rows_equals_scatter_tokens_and_its_gradient(lens, extra_width, seed):
    """Response masks of any lengths (zero included), padded wider than the longest row, as
    RolloutBatch.select leaves them: values and the gradient of a weighted sum both match."""
    g = torch.Generator().manual_seed(seed)
    mask = response_mask([[0] * n for n in lens], "cpu")
    mask = torch.cat([mask, torch.zeros(len(lens), extra_width)], dim=1)
    flat = torch.randn(sum(lens), generator=g, dtype=torch.float64)
    weight = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    grads = []
    for fn in (lambda x: scatter_tokens(x, mask), lambda x: scatter_rows(x, lens, mask)):
        x = flat.clone().requires_grad_()
        out = fn(x)
        (out * weight).sum().backward()
        grads.append((out.detach(), x.grad))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=0, atol=0)
    torch.testing.assert_close(grads[1][1], grads[0][1], rtol=0, atol=0)


def test_scatter_rows_zeroes_the_placeholder_micro_batch_even_for_non_finite_values():
    """select_micro's placeholder keeps a sequence's tokens under an all-zero mask: its values
    never reach the loss, not even as NaN · 0, and get no gradient."""
    x = torch.tensor([float("nan"), 1.0, float("inf")], requires_grad=True)
    out = scatter_rows(x, [3], torch.zeros(1, 4))
    assert torch.equal(out, torch.zeros(1, 4))
    out.sum().backward()
    assert torch.equal(x.grad, torch.zeros(3))


def test_scatter_rows_rejects_a_count_that_does_not_match_the_lengths():
    with pytest.raises(RuntimeError):
        scatter_rows(torch.zeros(4), [2, 1], torch.ones(2, 2))


def test_scatter_rows_with_trailing_dims_equals_one_scatter_per_column():
    """The update scatters log-probs and entropies stacked, [N, 2] -> [B, T, 2]."""
    lens, mask = [3, 0, 2], response_mask([[0] * 3, [], [0] * 2], "cpu")
    flat = torch.randn(5, 2, dtype=torch.float64)
    both = scatter_rows(flat, lens, mask)
    for k in range(2):
        torch.testing.assert_close(both[..., k], scatter_tokens(flat[:, k], mask), rtol=0, atol=0)
