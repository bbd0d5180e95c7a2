"""pass@k (minirl.evaluation.passk): the product form `python -m minirl eval` uses against the
definition, counted over every k-subset of the n samples in exact arithmetic."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minirl.evaluation.passk import ks_for, pass_at_k


def brute_force(n: int, c: int, k: int) -> Fraction:
    """The share of k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


@given(st.integers(1, 10).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_is_the_share_of_subsets_with_a_correct_sample(nck):
    n, c, k = nck
    assert pass_at_k(n, c, k) == pytest.approx(float(brute_force(n, c, k)), abs=1e-12)


@given(st.integers(1, 200).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_matches_the_binomial_form_at_large_n(nck):
    """Large n, where the binomials are huge: the product form against exact integers."""
    import math

    n, c, k = nck
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), abs=1e-12)


def test_pass_at_1_is_the_share_correct_and_ks_reach_n():
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    assert ks_for(1) == [1] and ks_for(6) == [1, 2, 4, 6] and ks_for(8) == [1, 2, 4, 8]
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
