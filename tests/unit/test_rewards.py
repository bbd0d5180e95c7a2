"""Tests of the rule rewards (minirl_plugins.rewards and helpers) and minirl.reward."""

from __future__ import annotations

import logging
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minirl.data.prompts import PromptRecord
from minirl.plugins import Registry
from minirl.reward.manager import RewardManager, place_scores
from minirl_plugins import rewards
from minirl_plugins.rewards import copy_reward, gsm8k_reward
from minirl_plugins.rewards import countdown as reward_countdown
from minirl_plugins.rewards.countdown import countdown_reward, evaluate, literals, parse_equation
from minirl_plugins.rewards.math import math_reward, normalize

# ---------------------------------------------------------------------------------------------
# gsm8k
# ---------------------------------------------------------------------------------------------

GSM8K_CASES = [
    ("So she has 42 left.\n#### 42", "42", 1.0),
    ("#### $1,234", "1234", 1.0),
    ("#### 1,234", "1,234", 1.0),
    ("#### -3", "-3", 1.0),
    ("The total is 42.\n#### 42.", "42", 1.0),  # a sentence's final period is not the number
    ("#### 5 then I reconsider.\n#### 7", "7", 1.0),  # the last answer counts
    ("#### 5 then I reconsider.\n#### 7", "5", 0.0),
    ("#### 41", "42", 0.0),
    ("The answer is 42.", "42", 0.0),  # no "####": no answer
    ("#### 42" + " and more words" * 30, "42", 0.0),  # "####" before the last 300 characters
    ("#### 42.5", "42.5", 1.0),
]


@pytest.mark.parametrize("response,truth,expected", GSM8K_CASES)
def test_gsm8k_golden(response, truth, expected):
    """verl's gsm8k rule: last "#### n" in the last 300 characters, "$" and "," stripped."""
    assert gsm8k_reward(response, truth, {}) == expected


def test_gsm8k_format_score_only_for_a_wrong_answer():
    """format_score pays a present-but-wrong answer; a missing answer still scores 0."""
    assert gsm8k_reward("#### 41", "42", {}, format_score=0.1) == 0.1
    assert gsm8k_reward("no answer", "42", {}, format_score=0.1) == 0.0


# ---------------------------------------------------------------------------------------------
# math
# ---------------------------------------------------------------------------------------------

MATH_CASES = [
    (r"so \boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{.5}", r"\frac12", 1.0),
    (r"\boxed{\dfrac{3}{4}}", r"\frac{3}{4}", 1.0),
    (r"\boxed{\tfrac34}", "3/4", 1.0),
    (r"\boxed{\frac{2}{4}}", r"\frac{1}{2}", 1.0),
    (r"\boxed{-\frac{1}{2}}", "-0.5", 1.0),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}", 1.0),  # nested braces
    (r"\boxed{\frac{\sqrt3}{2}}", r"\dfrac{\sqrt{3}}{2}", 1.0),
    (r"\boxed{\{1, 2\}}", r"\{1,2\}", 1.0),  # escaped braces are content
    (r"\boxed{1} first, then \boxed{2}", "2", 1.0),
    (r"\boxed{1} first, then \boxed{2}", "1", 0.0),
    (r"\fbox{7}", "7", 1.0),
    (r"$\boxed 7$", "7", 1.0),
    (r"\boxed{x = 5}", "5", 1.0),
    (r"\boxed{5\text{ cm}}", "5", 1.0),
    (r"\boxed{10 dollars}", "10", 1.0),
    (r"\boxed{\$10}", "10", 1.0),
    (r"\boxed{\left( 1, 2 \right)}", "(1,2)", 1.0),
    (r"\boxed{90^\circ}", "90", 1.0),
    (r"\boxed{1,000}", "1000", 1.0),
    (r"\boxed{5.}", "5", 1.0),
    (r"\boxed{3.0}", "3", 1.0),
    (r"\boxed{\text{(B)}}", "(B)", 1.0),
    (r"\boxed{x \rightarrow 1}", r"x\rightarrow1", 1.0),
    (r"\boxed{5x}", "5", 0.0),  # a variable is not a unit
    (r"\boxed{2}", "3", 0.0),
    (r"\boxed{0.33}", r"\frac{1}{3}", 0.0),
    ("the answer is 5", "5", 0.0),  # no box
    (r"\boxed{5", "5", 0.0),  # unclosed
    (r"\boxed{4}", r"\boxed{4}", 1.0),  # a boxed ground truth
]


@pytest.mark.parametrize("response,truth,expected", MATH_CASES)
def test_math_golden(response, truth, expected):
    """The normaliser must equate answers written differently and keep different ones apart."""
    assert math_reward(response, truth, {}) == expected


def test_math_oversized_answer_scores_zero_fast():
    """Normalising is quadratic in brace nesting; a hostile deeply nested box must be refused
    by length, not stall the reward phase."""
    nested = "\\boxed{" + "{" * 20000 + "1" + "}" * 20000 + "}"
    assert math_reward(nested, "1", {}) == 0.0


def test_math_normalize_is_idempotent_on_the_cases():
    """normalize(normalize(x)) == normalize(x): canonical forms are fixed points."""
    for _response, truth, _ in MATH_CASES:
        once = normalize(truth)
        assert normalize(once) == once


# ---------------------------------------------------------------------------------------------
# countdown
# ---------------------------------------------------------------------------------------------

GT = {"target": 24, "numbers": [2, 3, 4]}

COUNTDOWN_CASES = [
    ("<think>hm</think><answer>2 * 3 * 4</answer>", GT, 1.0),
    ("<answer>(4 × 3) × 2</answer>", GT, 1.0),
    ("<answer> 2 * 3 * 4 = 24 </answer>", GT, 1.0),  # a trailing "= result" is tolerated
    ("<answer>1 + 1</answer> no wait <answer>4 * 3 * 2</answer>", GT, 1.0),  # the last one counts
    ("<answer>(4 + 4) * 3</answer>", GT, 0.1),  # 4 used twice, 2 missing
    ("<answer>3 * 4 * 2 * 1</answer>", GT, 0.1),  # a number not given
    ("<answer>3 * 4</answer>", {"target": 12, "numbers": [2, 3, 4]}, 0.1),  # 2 missing
    ("<answer>2 + 3 + 4</answer>", GT, 0.1),  # wrong value
    ("<answer>5 / (2 - 2)</answer>", {"target": 1, "numbers": [2, 2, 5]}, 0.0),  # division by zero
    ("<answer>1 / 3 * 3</answer>", {"target": 1, "numbers": [1, 3, 3]}, 1.0),  # exact arithmetic
    ("<answer>-2 + 3 * 4 * 2 + 2</answer>", {"target": 24, "numbers": [2, 3, 4, 2, 2]}, 1.0),
    ("<answer>2.0 * 3 * 4</answer>", GT, 0.0),  # integers only
    ("<answer>2 * 3 * 4", GT, 0.0),  # unclosed
    ("2 * 3 * 4", GT, 0.0),  # no tags
    ("<answer></answer>", GT, 0.0),
    ("<answer>(2 * 3 * 4</answer>", GT, 0.0),
    ("<answer>2 ** 3 * 4</answer>", GT, 0.0),
]


@pytest.mark.parametrize("response,truth,expected", COUNTDOWN_CASES)
def test_countdown_golden(response, truth, expected):
    """Each number exactly once, value equal to the target; well-formed misses get 0.1 (verl)."""
    assert countdown_reward(response, truth, {}) == pytest.approx(expected)


def test_countdown_format_score_is_a_keyword():
    """A plugin can turn the shaping off with format_score=0."""
    assert countdown_reward("<answer>2 + 3 + 4</answer>", GT, {}, format_score=0.0) == 0.0


@pytest.mark.parametrize(
    "attack",
    [
        "__import__('os').system('touch /tmp/pwned')",
        "().__class__.__bases__[0]",
        "2 * 3 * 4 + len('x')",
        "9" * 5000,
        "(" * 400 + "2" + ")" * 400,
    ],
)
def test_countdown_injection_scores_zero_without_evaluation(attack, monkeypatch):
    """Hostile text is rejected by the tokenizer or parser: evaluate() is never reached, eval()
    is never used, and huge or deeply nested input cannot exhaust the stack."""

    def forbidden(*_):
        raise AssertionError("evaluated hostile input")

    monkeypatch.setattr(reward_countdown, "evaluate", forbidden)
    monkeypatch.setattr("builtins.eval", forbidden)
    assert countdown_reward(f"<answer>{attack}</answer>", GT, {}) == 0.0


def test_countdown_bad_ground_truth_raises():
    """A malformed row is a data error (counted by the RewardManager), not a silent 0."""
    with pytest.raises(ValueError, match="target, numbers"):
        countdown_reward("<answer>1</answer>", "24", {})


PREC = {"+": 1, "-": 1, "*": 2, "/": 2}
trees = st.recursive(
    st.integers(0, 60),
    lambda kids: st.tuples(st.sampled_from("+-*/"), kids, kids),
    max_leaves=10,
)


def frac_eval(tree):
    if isinstance(tree, int):
        return Fraction(tree)
    op, a, b = tree[0], frac_eval(tree[1]), frac_eval(tree[2])
    return {"+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b, "/": lambda: a / b}[op]()


def render(tree, minimal):
    """Fully parenthesised, or with only the parentheses precedence and associativity need."""
    if isinstance(tree, int):
        return str(tree)
    op, left, right = tree
    ls, rs = render(left, minimal), render(right, minimal)
    if not minimal or (not isinstance(left, int) and PREC[left[0]] < PREC[op]):
        ls = f"({ls})"
    if not minimal or (
        not isinstance(right, int) and (PREC[right[0]] < PREC[op] or PREC[right[0]] == PREC[op] and op in "-/")
    ):
        rs = f"({rs})"
    return f"{ls} {op} {rs}"


def leaves(tree):
    return [tree] if isinstance(tree, int) else leaves(tree[1]) + leaves(tree[2])


@settings(max_examples=300, deadline=None)
@given(trees, st.booleans())
def test_countdown_parser_matches_fraction_evaluation(tree, minimal):
    """The parser's value equals exact Fraction evaluation of random expression trees, under
    full and minimal parenthesisation (so precedence and left associativity are exercised)."""
    text = render(tree, minimal)
    parsed = parse_equation(text)
    assert literals(parsed) == leaves(tree)
    try:
        expected = frac_eval(tree)
    except ZeroDivisionError:
        with pytest.raises(ZeroDivisionError):
            evaluate(parsed)
        return
    assert evaluate(parsed) == expected


# ---------------------------------------------------------------------------------------------
# copy and registration
# ---------------------------------------------------------------------------------------------


def test_copy_reward():
    """The synthetic task: the stripped response must start with the ground truth."""
    assert copy_reward("  7 is the digit", "7", {}) == 1.0
    assert copy_reward("the digit is 7", "7", {}) == 0.0
    with pytest.raises(ValueError, match="empty"):
        copy_reward("anything", "", {})


def test_hook_registers_all_names():
    """verl's data_source strings must resolve, so verl-prepared parquet files score unchanged."""
    names = set(rewards.minirl_reward_functions())
    assert names == {
        "gsm8k",
        "openai/gsm8k",
        "math",
        "lighteval/MATH",
        "DigitalLearningGmbH/MATH-lighteval",
        "countdown",
        "copy",
        "lookup",
    }


# ---------------------------------------------------------------------------------------------
# RewardManager and place_scores
# ---------------------------------------------------------------------------------------------


def registry(**extra):
    reg = Registry("reward_functions")
    for name, fn in {**rewards.minirl_reward_functions(), **extra}.items():
        reg.add(name, fn, "test")
    return reg


def rec(source, truth, row=0):
    return PromptRecord([1], source, truth, {}, f"data.parquet:{row}", row)


def test_manager_dispatches_by_data_source():
    """Each row's data_source picks its function; scores come back in record order."""
    records = [rec("openai/gsm8k", "4"), rec("copy", "7"), rec("countdown", GT), rec("math", "2")]
    result = RewardManager(registry()).score(records, ["#### 4", "8", "<answer>2*3*4</answer>", r"\boxed{2}"])
    assert result.scores == [1.0, 0.0, 1.0, 1.0] and result.count("error") == 0


def test_manager_unknown_data_source_names_source_row_and_registered():
    """A typo in data_source fails before scoring, with everything needed to fix it."""
    with pytest.raises(ValueError) as err:
        RewardManager(registry()).score([rec("gsm9k", "4", row=5)], ["#### 4"])
    msg = str(err.value)
    assert "'gsm9k'" in msg and "data.parquet:5" in msg and "openai/gsm8k" in msg


def test_manager_counts_failing_functions_and_logs_once(caplog):
    """A raising (or NaN-returning) reward function scores 0 and is counted per source,
    logged once per source with the exception, and never stops training."""

    def boom(response, truth, extra):
        raise RuntimeError("broken grader")

    manager = RewardManager(registry(boom=boom, nan=lambda *a: math.nan))
    records = [rec("boom", "x", 0), rec("copy", "7", 1), rec("boom", "x", 2), rec("nan", "x", 3)]
    with caplog.at_level(logging.WARNING, logger="minirl.reward"):
        result = manager.score(records, ["a", "7", "b", "c"])
        manager.score(records[:1], ["again"])
    assert result.scores == [0.0, 1.0, 0.0, 0.0]
    assert result.count("error") == 3 and result.failures["error"] == {"boom": 2, "nan": 1}
    assert caplog.text.count("broken grader") == 1 and "data.parquet:0" in caplog.text
    assert "non-finite" in caplog.text


def test_manager_accepts_verl_dict_scores():
    """verl reward functions may return {"score": x}."""
    manager = RewardManager(registry(d=lambda r, t, e: {"score": 0.5, "acc": True}))
    assert manager.score([rec("d", "x")], ["r"]).scores == [0.5]
    with pytest.raises(AssertionError, match="2 records but 1 responses"):  # a caller's bug
        manager.score([rec("d", "x")] * 2, ["r"])


def test_place_scores_on_last_valid_token():
    """The outcome score sits on the last model token (the last 1 of the mask); a response
    without one has no token to hold it, so its row is all zero, which is the score the
    estimators see for it (they sum token rewards times the mask)."""
    mask_BT = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 0, 1, 0]], dtype=torch.float32)
    token_scores_BT = place_scores(torch.tensor([1.0, 0.5, 2.0, 3.0]), mask_BT)
    expected = torch.tensor([[0, 0, 1.0, 0], [0.5, 0, 0, 0], [0.0, 0, 0, 0], [0, 0, 3.0, 0]])
    assert torch.equal(token_scores_BT, expected)
    assert torch.equal(place_scores([1.0], torch.ones(1, 4)), torch.tensor([[0, 0, 0, 1.0]]))
    with pytest.raises(AssertionError, match=r"mask_BT must be \[B, T >= 1\]"):  # a caller's bug
        place_scores([1.0], torch.ones(4))
