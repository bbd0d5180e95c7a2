"""Calling reward functions: one call scores one row (naive) or a list of rows (batch).

`Scorers` holds the functions: the plugin registry (by data_source) or one custom function
(every data_source). It runs the same way in the training process and in a reward worker
(minirl.reward.pool), which rebuilds it from a picklable `RewardSource`. A function that raises
or returns something that is not a finite number gives an "error" outcome for its rows: a data
error, not a crash. A batch function that returns the wrong number of scores is a bug in it, and
a UserError.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Sequence

from minirl.errors import UserError, describe


@dataclass(frozen=True)
class Row:
    """What a reward function sees of one response."""

    data_source: str
    text: str
    ground_truth: Any
    extra_info: Any
    trajectory: Any = None  # multi-turn: minirl.reward.trajectory.reward_view; None: single turn


@dataclass
class Outcome:
    """The score of one row; failure is "", "error", "timeout" or "crash" (then score is 0)."""

    score: float = 0.0
    extras: dict[str, float] = field(default_factory=dict)  # a dict answer's other numeric keys
    failure: str = ""
    detail: str = ""


def as_score(value: Any) -> float:
    """A reward function may return a number, a bool, or verl's {"score": x, ...} dict."""
    if isinstance(value, dict):
        if "score" not in value:
            raise TypeError(f"a reward function's dict answer needs a 'score' key, got keys {sorted(value)}")
        value = value["score"]
    if hasattr(value, "numel") and value.numel() == 1:  # a one-element tensor or array
        value = value.item()
    if not isinstance(value, numbers.Real):  # bools and numpy scalars are Reals
        raise TypeError(f"a reward function must return a float, got {type(value).__name__}")
    score = float(value)
    if not math.isfinite(score):  # one NaN would poison every advantage in its group
        raise ValueError(f"a reward function returned the non-finite score {score}")
    return score


def _extras(value: Any) -> dict[str, float]:
    if not isinstance(value, dict):
        return {}
    out = {}
    for key, v in value.items():
        if key != "score" and isinstance(v, numbers.Real) and math.isfinite(float(v)):
            out[str(key)] = float(v)
    return out


def outcome_of(value: Any) -> Outcome:
    try:
        return Outcome(as_score(value), _extras(value))
    except (TypeError, ValueError) as exc:
        return Outcome(failure="error", detail=describe(exc))


class Scorers:
    """registry: data_source -> fn(response, ground_truth, extra_info); custom: verl's
    compute_score for every data_source; batch: custom takes lists and returns a list."""

    def __init__(self, registry: Any = None, custom: Any = None, batch: bool = False, what: str = "compute_score"):
        assert custom is not None or not batch, "a batch reward manager needs a custom reward function (validated)"
        self.registry, self.custom, self.batch, self.what = registry, custom, batch, what

    def run(self, rows: Sequence[Row]) -> list[Outcome]:
        """One call: the outcome of every row, in order."""
        return self._run_batch(rows) if self.batch else [self._run_one(row) for row in rows]

    def _run_one(self, row: Row) -> Outcome:
        try:
            if self.custom is not None:
                value = self.custom(
                    data_source=row.data_source,
                    solution_str=row.text,
                    ground_truth=row.ground_truth,
                    extra_info=row.extra_info,
                    **_trajectory_kwarg(self.custom, "trajectory", row.trajectory),
                )
            else:
                fn = self.registry.get(row.data_source)
                value = fn(
                    row.text, row.ground_truth, row.extra_info, **_trajectory_kwarg(fn, "trajectory", row.trajectory)
                )
        except Exception as exc:  # a broken reward function or row must not stop training
            return Outcome(failure="error", detail=describe(exc))
        return outcome_of(value)

    def _run_batch(self, rows: Sequence[Row]) -> list[Outcome]:
        try:
            values = self.custom(
                data_sources=[r.data_source for r in rows],
                solution_strs=[r.text for r in rows],
                ground_truths=[r.ground_truth for r in rows],
                extra_infos=[r.extra_info for r in rows],
                **_trajectory_kwarg(self.custom, "trajectories", [r.trajectory for r in rows]),
            )
        except Exception as exc:
            return [Outcome(failure="error", detail=describe(exc)) for _ in rows]
        n = len(values) if hasattr(values, "__len__") and not isinstance(values, (str, dict)) else None
        if n != len(rows):
            got = f"{n} scores" if n is not None else f"a {type(values).__name__}"
            raise UserError(
                f"batch reward function {self.what} returned {got} for {len(rows)} responses; it must return a "
                "list with one score per response, in order"
            )
        return [outcome_of(v) for v in values]


def _trajectory_kwarg(fn: Any, name: str, value: Any) -> dict:
    """{name: value} when fn takes that keyword (or **kwargs) and there is a trajectory: a reward
    function opts into seeing multi-turn trajectories by declaring the argument."""
    present = value is not None and (not isinstance(value, list) or any(v is not None for v in value))
    return {name: value} if present and _takes(fn, name) else {}


@functools.lru_cache(maxsize=256)
def _takes(fn: Any, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


@dataclass(frozen=True)
class RewardSource:
    """Where a reward worker gets its Scorers: the custom file, or the plugin registry rebuilt
    from the same plugin modules (registered functions may be closures, which do not pickle)."""

    custom_path: str = ""
    custom_name: str = "compute_score"
    batch: bool = False
    plugin_modules: tuple[str, ...] = ()

    def load(self) -> Scorers:
        if self.custom_path:
            from minirl.reward.custom import load_custom_function

            fn = load_custom_function(self.custom_path, self.custom_name, self.batch)
            return Scorers(custom=fn, batch=self.batch, what=f"{self.custom_name} of {self.custom_path}")
        from minirl.plugins import PluginManager

        return Scorers(registry=PluginManager(self.plugin_modules)["reward_functions"])
