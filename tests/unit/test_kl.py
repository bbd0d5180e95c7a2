"""KL estimators (docs/algorithms.md §3): signs, zeros, gradients, unbiasedness, and the exact `full`."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minirl_plugins.algorithms.kl import FullKL, minirl_kl_estimators

FAST = settings(max_examples=30, deadline=None)
KL = minirl_kl_estimators()
PER_TOKEN = sorted(name for name, fn in KL.items() if not getattr(fn, "needs_logits", False))
BASE = {"k1": "k1", "kl": "k1", "abs": "abs", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3"}

log_probs = st.lists(st.floats(-30.0, 0.0), min_size=1, max_size=12)


def _pair(lp, ref):
    n = min(len(lp), len(ref))
    return torch.tensor(lp[:n], dtype=torch.float64), torch.tensor(ref[:n], dtype=torch.float64)


@FAST
@given(
    lp=log_probs,
    ref=log_probs,
    name=st.sampled_from(["k2", "mse", "k3", "low_var_kl", "abs", "k2+", "k3+", "abs+"]),
)
def test_k2_k3_abs_are_non_negative(lp, ref, name):
    """k2, k3 and abs (and their straight-through forms) are >= 0 for any pair of log-probs; a
    negative KL penalty would reward moving away from the reference."""
    logp, ref_logp = _pair(lp, ref)
    assert bool((KL[name](logp, ref_logp) >= 0).all())


@FAST
@given(lp=log_probs, name=st.sampled_from(PER_TOKEN))
def test_every_estimator_is_zero_at_equality(lp, name):
    """All estimators (and every "+" variant) are exactly 0 when logp == ref_logp."""
    logp = torch.tensor(lp, dtype=torch.float64)
    assert torch.equal(KL[name](logp, logp.clone()), torch.zeros_like(logp))


@FAST
@given(lp=log_probs, name=st.sampled_from(["k3", "low_var_kl", "k2", "k3+", "k1+", "abs+"]))
def test_gradient_is_zero_at_equality(lp, name):
    """The gradient of k3 (and of k2, hence of every "+" variant) vanishes at d = 0: the KL loss
    does not push an on-reference policy anywhere."""
    logp = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    KL[name](logp, logp.detach().clone()).sum().backward()
    assert torch.equal(logp.grad, torch.zeros_like(logp))


@FAST
@given(lp=log_probs, ref=log_probs, name=st.sampled_from(sorted(BASE)))
def test_straight_through_has_named_forward_and_k2_gradient(lp, ref, name):
    """name+ must give the forward value of `name` bit for bit and the gradient of k2 (to logp
    and to ref_logp)."""
    logp, ref_logp = _pair(lp, ref)
    grads = {}
    for est in (f"{name}+", "k2"):
        a, b = logp.clone().requires_grad_(), ref_logp.clone().requires_grad_()
        value = KL[est](a, b)
        value.sum().backward()
        grads[est] = (value.detach(), a.grad, b.grad)
    assert torch.equal(grads[f"{name}+"][0], KL[name](logp, ref_logp))
    torch.testing.assert_close(grads[f"{name}+"][1:], grads["k2"][1:])


@settings(max_examples=6, deadline=None)  # 200k samples each
@given(seed=st.integers(0, 2**31 - 1), spread=st.floats(0.3, 1.5))
def test_sample_means_of_k1_and_k3_approach_the_true_kl(seed, spread):
    """k1 and k3 are unbiased: their mean over tokens sampled from π approaches KL(π‖π_ref).

    k3 is clamped to [-10, 10] (docs/algorithms.md §3), which biases it where log π_ref − log π
    exceeds about 2.6; there its sample mean must approach the exact expectation of the clamped
    estimator, which equals the true KL whenever the clamp is inactive on every token.
    Tolerance: 6 standard errors of the sample mean (plus 1e-3), so a false alarm is negligible."""
    gen = torch.Generator().manual_seed(seed)
    log_pi = torch.log_softmax(spread * torch.randn(6, generator=gen, dtype=torch.float64), -1)
    log_ref = torch.log_softmax(spread * torch.randn(6, generator=gen, dtype=torch.float64), -1)
    true_kl = (log_pi.exp() * (log_pi - log_ref)).sum().item()
    tokens = torch.multinomial(log_pi.exp(), 200_000, replacement=True, generator=gen)
    for name in ("k1", "k3"):
        per_token = KL[name](log_pi, log_ref)
        expected = (log_pi.exp() * per_token).sum().item()
        if name == "k1" or per_token.abs().max() < 10:
            assert math.isclose(expected, true_kl, rel_tol=1e-9, abs_tol=1e-12), name
        samples = per_token[tokens]
        tolerance = 6 * samples.std().item() / math.sqrt(samples.numel()) + 1e-3
        assert abs(samples.mean().item() - expected) < tolerance, name


@FAST
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 11), chunk=st.integers(1, 5), scale=st.floats(0.1, 8.0))
def test_full_kl_equals_exact_float64_sum_values_and_gradients(seed, n, chunk, scale):
    """`full` (chunked, checkpointed) must equal Σ_v π(log π − log π_ref) in float64, and so must
    its gradient to the policy logits; it is >= 0 up to rounding and needs_logits is set."""
    gen = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(n, 29, generator=gen)).requires_grad_()
    ref_logits = scale * torch.randn(n, 29, generator=gen)
    weights = torch.randn(n, generator=gen, dtype=torch.float64)
    got = FullKL(chunk_size=chunk)(logits, ref_logits)
    (got.double() * weights).sum().backward()

    logits64 = logits.detach().double().requires_grad_()
    log_p, log_q = torch.log_softmax(logits64, -1), torch.log_softmax(ref_logits.double(), -1)
    ref = (log_p.exp() * (log_p - log_q)).sum(-1)
    (ref * weights).sum().backward()

    assert KL["full"].needs_logits and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits.grad.double(), logits64.grad, rtol=1e-3, atol=1e-5)
    assert bool((got > -1e-5).all())


def test_full_kl_is_zero_at_equal_logits_and_bounded_in_memory():
    """Equal logits give 0 (up to float32 rounding); under no_grad no checkpoint is used; the
    reference logits never receive a gradient (the reference is frozen)."""
    logits = torch.randn(7, 13, requires_grad=True)
    ref_logits = logits.detach().clone().requires_grad_()
    kl = FullKL(chunk_size=3)(logits, ref_logits)
    torch.testing.assert_close(kl, torch.zeros(7), atol=1e-6, rtol=0)
    kl.sum().backward()
    assert ref_logits.grad is None
    with torch.no_grad():
        assert FullKL(chunk_size=3)(logits, ref_logits).shape == (7,)


def test_golden_values():
    """Hand values at d = lp − lp_ref = 0.5: k1 0.5, abs 0.5, k2 0.125, k3 = e^−0.5 + 0.5 − 1 =
    0.106531; at d = −0.5: k1 −0.5, abs 0.5, k3 = e^0.5 − 0.5 − 1 = 0.148721. k3 clamps: d = −30
    gives x = 20 (clamped), e^20 − 21 clamped to 10."""
    lp = torch.tensor([0.0, -1.0, -30.0], dtype=torch.float64)
    ref = torch.tensor([-0.5, -0.5, 0.0], dtype=torch.float64)
    torch.testing.assert_close(KL["k1"](lp, ref), torch.tensor([0.5, -0.5, -30.0], dtype=torch.float64))
    torch.testing.assert_close(KL["abs"](lp, ref), torch.tensor([0.5, 0.5, 30.0], dtype=torch.float64))
    torch.testing.assert_close(KL["k2"](lp, ref), torch.tensor([0.125, 0.125, 450.0], dtype=torch.float64))
    expected_k3 = torch.tensor([math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5, 10.0], dtype=torch.float64)
    torch.testing.assert_close(KL["k3"](lp, ref), expected_k3)


def test_registry_names_and_aliases():
    """Every name of the table, every "+" variant, and aliases that are the same estimator."""
    expected = {"k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "full"}
    expected |= {f"{n}+" for n in ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")}
    assert set(KL) == expected
    assert KL["kl"] is KL["k1"] and KL["mse"] is KL["k2"] and KL["low_var_kl"] is KL["k3"]
