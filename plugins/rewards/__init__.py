"""Built-in rule rewards, registered by data_source: gsm8k, math, countdown, copy, lookup.

Each is a plain function (response, ground_truth, extra_info) -> float; options are keyword
arguments with defaults (wrap with functools.partial in your own plugin to change them).
Names include verl's data_source strings so verl-prepared parquet files score unchanged.
"""

from __future__ import annotations

import re
from typing import Any

from minirl import hookimpl
from minirl_plugins.rewards.countdown import countdown_reward
from minirl_plugins.rewards.math import math_reward

GSM8K_TAIL = 300  # only the end of a response counts: an early "####" is not the final answer
GSM8K_ANSWER = re.compile(r"####\s*(-?\s*\$?\s*-?[0-9][0-9.,]*)")


def _clean_number(text: str) -> str:
    """ "$1,234." -> "1234": currency signs, thousands commas, spaces and a sentence's final
    "." are decoration, not part of the number."""
    return re.sub(r"[\s$,]", "", text).rstrip(".")


def gsm8k_reward(
    response: str, ground_truth: Any, extra_info: dict | None = None, *, format_score: float = 0.0, score: float = 1.0
) -> float:
    """score when the last "#### <number>" in the last 300 characters equals the ground truth
    (as text, after stripping "$" and commas), else format_score; 0.0 without any "####"."""
    matches = GSM8K_ANSWER.findall(response[-GSM8K_TAIL:])
    if not matches:
        return 0.0
    return score if _clean_number(matches[-1]) == _clean_number(str(ground_truth)) else format_score


def copy_reward(response: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """1.0 when the stripped response starts with the ground truth: a task a tiny model learns
    in a few steps, so end-to-end tests can check that training raises the reward."""
    truth = str(ground_truth)
    if not truth:
        raise ValueError("copy: the ground truth is empty; every response would match it")
    return 1.0 if response.strip().startswith(truth) else 0.0


FOUND_SCORE = 0.1  # lookup: a successful call, the answer wrong (or missing)
DIGIT_SCORE = 0.1  # lookup: after a successful call, a wrong answer that is at least a digit


def lookup_reward(
    response: str, ground_truth: Any, extra_info: dict | None = None, trajectory: dict | None = None
) -> float:
    """The multi-turn lookup task (scripts/make_data.py): 1.0 when the stripped final answer
    starts with the ground-truth digit; else, when the trajectory holds a successful lookup call
    (a tool message of digits, read by a later assistant turn), 0.1 plus 0.1 if the answer starts
    with a digit; else 0.0.

    Why the partial credit: the digit is only in the tool's reply, so a random-init policy must
    first find the call (one token in 264 with the tiny-agent tokenizer), then answer with a digit
    at all (10 tokens in 264), and only then can it learn which digit the reply states. Each rung
    pays a little so that it is worth repeating before any answer is right (without the digit's
    rung the answer position drifted over non-digit tokens for a hundred steps). The reward that
    counts is 1 for the right digit: guessing without the call earns 0.1 on average, calling and
    then guessing a digit 0.28, calling and copying the reply 1.0.
    trajectory: what minirl.reward.trajectory.reward_view gives (None for a single-turn rollout)."""
    truth = str(ground_truth)
    if not truth:
        raise ValueError("lookup: the ground truth is empty; every response would match it")
    answer = response.strip()
    if answer.startswith(truth):
        return 1.0
    if not _looked_up(trajectory):
        return 0.0
    return FOUND_SCORE + (DIGIT_SCORE if answer[:1].isdigit() else 0.0)


def _looked_up(trajectory: dict | None) -> bool:
    """A lookup reply the model read: a tool message of digits (the value, maybe stated several
    times: "7 7 7"; not an "Error: ..."), followed by an assistant turn. tool_agent records the
    tool's reply in the messages even when it did not fit the response budget and was never shown
    to the model (the trajectory then ends on it); such a call earns nothing, or calling at the
    end of a long response would pay."""
    messages = (trajectory or {}).get("messages") or []
    return any(
        m.get("role") == "tool"
        and m.get("name", "lookup") == "lookup"
        and str(m.get("content", "")).replace(" ", "").isdigit()
        and any(later.get("role") == "assistant" for later in messages[i + 1 :])
        for i, m in enumerate(messages)
    )


@hookimpl
def minirl_reward_functions() -> dict:
    return {
        "gsm8k": gsm8k_reward,
        "openai/gsm8k": gsm8k_reward,
        "math": math_reward,
        "lighteval/MATH": math_reward,
        "DigitalLearningGmbH/MATH-lighteval": math_reward,
        "countdown": countdown_reward,
        "copy": copy_reward,
        "lookup": lookup_reward,
    }
