"""Built-in rule rewards, registered by data_source: gsm8k, math, countdown, copy.

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
    }
