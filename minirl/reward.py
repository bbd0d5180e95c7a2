"""Scoring responses with the rule reward functions, and placing the scores on tokens.

Each record's data_source picks a function from the reward registry (filled by the
`minirl_reward_functions` hook). A function that raises or returns a non-finite or non-number
value is a data error, not a crash: the response scores 0, the error is counted per
data_source (for the step's metrics) and logged once per data_source with the exception.

Shape legend: B sequences, T response positions.
"""

from __future__ import annotations

import logging
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from minirl.errors import UserError

log = logging.getLogger(__name__)


@dataclass
class RewardResult:
    """scores: one per response; n_errors: responses whose reward function failed (scored 0);
    errors_by_source: data_source -> number of failures."""

    scores: list[float]
    n_errors: int = 0
    errors_by_source: dict[str, int] = field(default_factory=dict)


def _registered_names(registry: Any) -> list[str]:
    """Names in a minirl Registry (whose .items is a dict) or in a plain mapping."""
    items = getattr(registry, "items", None)
    names = registry.keys() if callable(items) else items
    return sorted(names or [])


def _as_score(value: Any) -> float:
    """A reward function may return a number, a bool, or verl's {"score": x, ...} dict."""
    if isinstance(value, dict) and "score" in value:
        value = value["score"]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, numbers.Real):  # bools and numpy scalars are Reals
        raise TypeError(f"a reward function must return a float, got {type(value).__name__}")
    score = float(value)
    if not math.isfinite(score):  # one NaN would poison every advantage in its group
        raise ValueError(f"a reward function returned the non-finite score {score}")
    return score


class RewardManager:
    """Scores decoded responses by each record's data_source."""

    def __init__(self, registry: Any, tokenizer: Any = None):
        self.registry = registry
        self.tokenizer = tokenizer
        self._warned: set[str] = set()  # per manager, so each run logs each source once

    def _functions(self, records: Sequence[Any]) -> dict[str, Any]:
        """Look up every data_source before scoring, so a typo fails before any work is done."""
        names = _registered_names(self.registry)
        fns: dict[str, Any] = {}
        for rec in records:
            if rec.data_source in fns:
                continue
            if rec.data_source not in names:
                raise UserError(
                    f"{rec.source}: data_source {rec.data_source!r} has no reward function; "
                    f"registered: {', '.join(names) or '(none)'}. Fix the data_source column or "
                    f"register a function for it with the minirl_reward_functions hook"
                )
            fns[rec.data_source] = self.registry.get(rec.data_source)
        return fns

    def score(self, records: Sequence[Any], responses_text: Sequence[str]) -> RewardResult:
        """Score response i against records[i] (records already expanded n times per prompt)."""
        if len(records) != len(responses_text):
            raise ValueError(f"{len(records)} records but {len(responses_text)} responses")
        fns = self._functions(records)
        result = RewardResult(scores=[])
        for rec, text in zip(records, responses_text):
            try:
                score = _as_score(fns[rec.data_source](text, rec.ground_truth, rec.extra_info))
            except Exception as exc:  # a broken reward function or row must not stop training
                score = 0.0
                self._record_error(result, rec, exc)
            result.scores.append(score)
        return result

    def score_ids(self, records: Sequence[Any], response_ids: Sequence[Sequence[int]]) -> RewardResult:
        """Decode (skipping special tokens such as EOS) with the tokenizer, then score."""
        if self.tokenizer is None:
            raise ValueError("RewardManager.score_ids needs a tokenizer; pass one to RewardManager")
        texts = [self.tokenizer.decode(list(ids), skip_special_tokens=True) for ids in response_ids]
        return self.score(records, texts)

    def _record_error(self, result: RewardResult, rec: Any, exc: Exception) -> None:
        result.n_errors += 1
        counts = result.errors_by_source
        counts[rec.data_source] = counts.get(rec.data_source, 0) + 1
        if rec.data_source not in self._warned:
            self._warned.add(rec.data_source)
            log.warning(
                "reward function for data_source %r failed on %s (%s: %s); scoring 0. Further "
                "failures of this data_source are counted in the metrics, not logged.",
                rec.data_source,
                rec.source,
                type(exc).__name__,
                exc,
            )


def place_scores(scores_B: Any, response_lengths_B: Any, T: int) -> torch.Tensor:
    """token_scores_BT: each score on its response's last valid token (index length - 1).

    A zero-length response has no valid token, so its row is all zero: the estimators read a
    sequence's score as Σ token_rewards·mask (plugins/advantage.py, convention 1), which is 0
    for it whatever it scored, and this row says the same.
    """
    scores_B = torch.as_tensor(scores_B, dtype=torch.float32)
    lengths_B = torch.as_tensor(response_lengths_B, dtype=torch.long, device=scores_B.device)
    if scores_B.ndim != 1 or scores_B.shape != lengths_B.shape:
        raise ValueError(f"scores {tuple(scores_B.shape)} and lengths {tuple(lengths_B.shape)} must be (B,)")
    if T < 1:
        raise ValueError(f"T = {T}: the response tensor needs at least one position")
    if bool((lengths_B > T).any()) or bool((lengths_B < 0).any()):
        raise ValueError(f"response lengths must lie in [0, {T}], got {lengths_B.tolist()}")
    token_scores_BT = torch.zeros(len(scores_B), T, dtype=torch.float32, device=scores_B.device)
    last_B = (lengths_B - 1).clamp(min=0)
    placed_B = torch.where(lengths_B > 0, scores_B, torch.zeros_like(scores_B))
    token_scores_BT[torch.arange(len(scores_B), device=scores_B.device), last_B] = placed_B
    return token_scores_BT
