"""Log-probs and entropies: the chunked, recomputing path must equal the plain reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minirl.forward.logprob import chunked_logprobs

FAST = settings(max_examples=25, deadline=None)
IDENTITY = torch.nn.Identity()  # a "head" that makes chunked_logprobs take the logits themselves


def _reference(logits_NV, labels_N, temperature):
    """log_softmax(logits / T)[label] and −Σ p log p, the plain way: the full float32 [N, V] log-softmax."""
    logp_NV = torch.log_softmax(logits_NV.float() / temperature, dim=-1)
    return logp_NV.gather(-1, labels_N.long().unsqueeze(-1)).squeeze(-1), -(logp_NV.exp() * logp_NV).sum(-1)


def _problem(seed: int, n: int, hidden: int = 8, vocab: int = 37):
    gen = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=gen))
    hidden_NH = torch.randn(n, hidden, generator=gen, requires_grad=True)
    labels_N = torch.randint(0, vocab, (n,), generator=gen)
    weights_N = torch.randn(n, generator=gen)  # a random downstream loss, to test gradients
    return head, hidden_NH, labels_N, weights_N


@settings(max_examples=15, deadline=None)  # each example runs two autograd passes
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 13),
    chunk=st.integers(1, 6),
    temperature=st.sampled_from([1.0, 0.6, 1.3]),
    recompute=st.booleans(),
    with_entropy=st.booleans(),
)
def test_chunked_logprobs_match_reference_values_and_gradients(seed, n, chunk, temperature, recompute, with_entropy):
    """chunked_logprobs (any chunk size, with or without checkpoint recomputation, any temperature)
    must give the values and the gradients (to the hidden states and to the head weight) of
    log_softmax(head(h) / T) + gather; the entropy too when asked for."""
    head, h_NH, y_N, w_N = _problem(seed, n)
    ref_logp, ref_ent = _reference(head(h_NH), y_N, temperature)
    ref_loss = (w_N * ref_logp).sum() + (ref_ent.sum() if with_entropy else 0.0)
    ref_grads = torch.autograd.grad(ref_loss, [h_NH, head.weight])

    logp, ent = chunked_logprobs(
        h_NH, head, y_N, temperature, chunk_size=chunk, with_entropy=with_entropy, recompute=recompute
    )
    loss = (w_N * logp).sum() + (ent.sum() if with_entropy else 0.0)
    grads = torch.autograd.grad(loss, [h_NH, head.weight])

    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    assert (ent is None) == (not with_entropy)
    if with_entropy:
        torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    for got, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


@FAST
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 9), scale=st.floats(0.01, 50.0))
def test_entropy_matches_float64_reference(seed, n, scale):
    """H = logsumexp(z) − Σ softmax(z)·z must equal −Σ p log p computed in float64, from nearly
    uniform (small scale) to nearly one-hot (large scale) distributions, and lie in [0, log V]."""
    gen = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(n, 50, generator=gen)
    p64 = torch.softmax(logits.double(), -1)
    ref = -(p64 * torch.log_softmax(logits.double(), -1)).sum(-1)
    _, got = chunked_logprobs(logits, IDENTITY, torch.zeros(n, dtype=torch.long), with_entropy=True)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)
    assert bool((got > -1e-5).all()) and bool((got < torch.log(torch.tensor(50.0)) + 1e-5).all())


@FAST
@given(seed=st.integers(0, 2**31 - 1), temperature=st.floats(0.2, 3.0))
def test_logprobs_from_bfloat16_logits_are_float32_of_scaled_logits(seed, temperature):
    """Logits are cast to float32 *before* the division by the temperature: the result must equal
    the float64 log-softmax of the (bf16-rounded) logits / T."""
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(6, 40, generator=gen)).to(torch.bfloat16)
    labels = torch.randint(0, 40, (6,), generator=gen)
    got, _ = chunked_logprobs(logits, IDENTITY, labels, temperature)
    ref = torch.log_softmax(logits.double() / temperature, -1).gather(-1, labels[:, None]).squeeze(-1)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_recompute_keeps_no_full_logits_for_backward():
    """The point of recompute=True: autograd must not keep any chunk's [n, V] logits; only the
    hidden chunks. Without recompute it keeps at least N×V floats (the memory we avoid)."""
    head, h_NH, y_N, _ = _problem(0, n=64, hidden=4, vocab=1000)
    for recompute, expect_small in ((True, True), (False, False)):
        saved: list[int] = []

        def pack(t, saved=saved):
            saved.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            chunked_logprobs(h_NH, head, y_N, 1.0, chunk_size=16, with_entropy=True, recompute=recompute)
        assert (max(saved, default=0) < 16 * 1000) == expect_small
        assert (sum(saved) < 64 * 1000) == expect_small


def test_no_grad_path_and_empty_input():
    """Under torch.no_grad (old/ref log-prob passes) checkpointing is skipped and results agree;
    zero positions return empty float32 tensors instead of failing in torch.cat."""
    head, h_NH, y_N, _ = _problem(1, n=5)
    with torch.no_grad():
        logp, ent = chunked_logprobs(h_NH, head, y_N, 0.7, chunk_size=2, with_entropy=True)
        ref, _ = _reference(head(h_NH), y_N, 0.7)
    torch.testing.assert_close(logp, ref)
    assert not logp.requires_grad and ent.shape == (5,)
    empty, empty_ent = chunked_logprobs(h_NH[:0], head, y_N[:0], 1.0, with_entropy=True)
    assert empty.shape == (0,) and empty.dtype == torch.float32 and empty_ent.shape == (0,)


def test_bad_temperature_and_chunk_size_are_user_errors():
    """Temperature 0 (greedy) would divide by zero: a ValueError that names it and the fix."""
    head, h_NH, y_N, _ = _problem(2, n=3)
    with pytest.raises(ValueError, match="temperature"):
        chunked_logprobs(h_NH, head, y_N, 0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_logprobs(h_NH, head, y_N, 1.0, chunk_size=0)


def test_golden_uniform_logits():
    """Hand values: V equal logits give log-prob −log V for every label and entropy log V, at
    any temperature."""
    logits = torch.zeros(3, 8)
    labels = torch.tensor([0, 3, 7])
    logp, ent = chunked_logprobs(logits, IDENTITY, labels, 0.5, with_entropy=True)
    torch.testing.assert_close(logp, torch.full((3,), -torch.log(torch.tensor(8.0))))
    torch.testing.assert_close(ent, torch.full((3,), torch.log(torch.tensor(8.0))))
