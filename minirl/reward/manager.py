"""Scoring responses with the reward functions (docs/algorithms.md §8), and placing the scores on tokens.

reward.reward_manager = "batch" scores many responses per call; reward.num_workers > 0 runs the
calls in worker processes (minirl.reward.pool), 0 in this process under a timer
(minirl.reward.deadline); either way a call is abandoned after reward.timeout_s. A function
that raises or returns a non-finite or non-number value, a call that times out and a worker
that crashes are data failures, not crashes of the run: the response scores 0, and the failure
is counted per kind and data_source (for the step's metrics) and logged once per kind and
data_source.

Shape legend: B sequences, T response positions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from minirl.errors import UserError
from minirl.reward.deadline import CallTimeout, call_with_deadline
from minirl.reward.pool import RewardPool
from minirl.reward.scorers import Outcome, RewardSource, Row, Scorers

log = logging.getLogger("minirl.reward")

FAILURES = ("error", "timeout", "crash")
METRIC = {"error": "reward/errors", "timeout": "reward/timeouts", "crash": "reward/crashes"}


@dataclass
class RewardResult:
    """scores: one per response; failures: kind ("error", "timeout", "crash") -> data_source ->
    number of responses scored 0 for it; extras: key -> the values of that key of dict answers."""

    scores: list[float]
    failures: dict[str, dict[str, int]] = field(default_factory=lambda: {k: {} for k in FAILURES})
    extras: dict[str, list[float]] = field(default_factory=dict)

    def count(self, kind: str) -> int:
        return sum(self.failures[kind].values())


class RewardManager:
    """Scores decoded responses: by data_source, or with one custom function; in this process
    or in a RewardPool. `close()` stops the pool's workers."""

    def __init__(self, registry: Any, *, scorers: Scorers | None = None, pool=None, chunks=1, timeout_s=0.0):
        self.registry = registry  # every data_source must be in it, unless a custom function scores all
        self.timeout_s = timeout_s  # per call in this process (0: none); a pool has its own
        self.scorers = scorers or Scorers(registry=registry)
        self.pool: RewardPool | None = pool
        self.chunks = chunks  # calls per batch (a batch manager splits the responses over the workers)
        self._warned: set[tuple[str, str]] = set()  # per manager, so each run logs each source once

    def check_sources(self, records: Sequence[Any]) -> None:
        """Look up every data_source before scoring, so a typo fails before any work is done."""
        if self.scorers.custom is not None:
            return
        for rec in records:
            if rec.data_source not in self.registry:
                items = self.registry.items  # a minirl Registry's dict, or a plain mapping's method
                names = sorted(items if isinstance(items, dict) else self.registry)
                raise UserError(
                    f"{rec.source}: data_source {rec.data_source!r} has no reward function; "
                    f"registered: {', '.join(names) or '(none)'}. Fix the data_source column, point "
                    "custom_reward_function.path at a Python file with verl's compute_score (it scores every "
                    "data_source), or register a function for it with the minirl_reward_functions hook"
                )

    def score(
        self, records: Sequence[Any], responses_text: Sequence[str], trajectories: Sequence[Any] | None = None
    ) -> RewardResult:
        """Score response i against records[i] (records already expanded n times per prompt).
        trajectories[i]: what a reward function that takes `trajectory` sees of a multi-turn
        sample (None for a single turn)."""
        assert len(records) == len(responses_text), f"{len(records)} records but {len(responses_text)} responses"
        self.check_sources(records)
        trajectories = trajectories or [None] * len(records)
        rows = [
            Row(r.data_source, text, r.ground_truth, _with_turns(r.extra_info, traj), traj)
            for r, text, traj in zip(records, responses_text, trajectories)
        ]
        outcomes = [o for call in self._run(self._calls(rows)) for o in call]
        result = RewardResult(scores=[])
        for rec, outcome in zip(records, outcomes):
            result.scores.append(outcome.score if not outcome.failure else 0.0)
            if outcome.failure:
                self._record_failure(result, rec, outcome)
            for key, v in outcome.extras.items():
                result.extras.setdefault(key, []).append(v)
        return result

    def _calls(self, rows: list[Row]) -> list[list[Row]]:
        """naive: one call per row; batch: `chunks` contiguous calls (order is kept)."""
        if not self.scorers.batch:
            return [[row] for row in rows]
        size = max(1, -(-len(rows) // self.chunks))
        return [rows[i : i + size] for i in range(0, len(rows), size)]

    def _run(self, calls: list[list[Row]]) -> list[list[Outcome]]:
        if self.pool is None:
            return [self._run_here(call) for call in calls]
        return self.pool.run(calls)

    def _run_here(self, call: list[Row]) -> list[Outcome]:
        """One call in this process, abandoned after timeout_s (minirl.reward.deadline)."""
        if self.timeout_s <= 0:
            return self.scorers.run(call)
        try:
            return call_with_deadline(lambda: self.scorers.run(call), self.timeout_s)
        except CallTimeout:
            detail = f"still running after {self.timeout_s:g} s, abandoned (reward.timeout_s)"
            return [Outcome(failure="timeout", detail=detail) for _ in call]

    def close(self) -> None:
        """Stop the worker processes, if any (a later score() starts them again)."""
        if self.pool is not None:
            self.pool.close()

    def _record_failure(self, result: RewardResult, rec: Any, outcome: Outcome) -> None:
        counts = result.failures[outcome.failure]
        counts[rec.data_source] = counts.get(rec.data_source, 0) + 1
        if (outcome.failure, rec.data_source) in self._warned:
            return
        self._warned.add((outcome.failure, rec.data_source))
        what = {"error": "failed", "timeout": "timed out", "crash": "crashed its worker"}[outcome.failure]
        log.warning(
            "reward function for data_source %r %s on %s (%s); scoring 0. Further cases of this data_source "
            "are counted in the metric %s, not logged.",
            rec.data_source,
            what,
            rec.source,
            outcome.detail,
            METRIC[outcome.failure],
        )


def build_reward_manager(reward_cfg, custom_cfg, registry: Any, plugin_modules=()) -> RewardManager:
    """The RewardManager of the [reward] and [custom_reward_function] sections."""
    batch = reward_cfg.reward_manager == "batch"
    source = RewardSource(custom_cfg.path, custom_cfg.name, batch, tuple(plugin_modules))
    scorers = source.load() if custom_cfg.path else Scorers(registry=registry)
    pool = RewardPool(source.load, reward_cfg.num_workers, reward_cfg.timeout_s) if reward_cfg.num_workers else None
    chunks = max(1, reward_cfg.num_workers)
    return RewardManager(registry, scorers=scorers, pool=pool, chunks=chunks, timeout_s=reward_cfg.timeout_s)


def place_scores(scores_B: Any, mask_BT: torch.Tensor) -> torch.Tensor:
    """token_scores_BT: each score on its response's last model token (the last 1 of its mask).

    Not at index length - 1: a multi-turn response may end in tool tokens (mask 0), which carry
    no reward. With a contiguous mask the last 1 is at length - 1, so single-turn scores sit where
    they always did. A row without a model token has nowhere to hold its score and stays all
    zero: the estimators read a sequence's score as Σ token_rewards·mask
    (plugins/algorithms/advantage.py, convention 1), which is 0 for it whatever it scored.
    """
    assert mask_BT.ndim == 2 and mask_BT.shape[1] >= 1, f"mask_BT must be [B, T >= 1], got {tuple(mask_BT.shape)}"
    scores_B = torch.as_tensor(scores_B, dtype=torch.float32).to(mask_BT.device)
    assert scores_B.shape == mask_BT.shape[:1], (scores_B.shape, mask_BT.shape)
    pos_BT = torch.arange(mask_BT.shape[1], device=mask_BT.device).expand_as(mask_BT)
    last_B = torch.where(mask_BT.bool(), pos_BT, -1).amax(-1)  # -1: no model token
    placed_B = torch.where(last_B >= 0, scores_B, torch.zeros_like(scores_B))
    token_scores_BT = torch.zeros(mask_BT.shape, dtype=torch.float32, device=mask_BT.device)
    token_scores_BT[torch.arange(len(scores_B), device=mask_BT.device), last_B.clamp(min=0)] = placed_B
    return token_scores_BT


def _with_turns(extra_info: Any, trajectory: Any) -> Any:
    """A multi-turn row's extra_info with num_turns added, as verl's reward managers add it."""
    if not trajectory or not isinstance(extra_info, dict):
        return extra_info
    return {**extra_info, "num_turns": trajectory["num_turns"]}
