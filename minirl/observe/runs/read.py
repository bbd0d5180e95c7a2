"""A run directory as data: its metrics.jsonl (one JSON object per step) and its config.toml.

Pure json, no pandas. Tolerant of what real runs leave behind:
- a line cut short (a run still writing, or one that crashed) is skipped with a warning;
- a step logged twice (a resume that re-did it) keeps the later line;
- null (a non-finite value) counts as missing;
- the step-0 line holds only the validation before training.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from minirl.config.load import flatten, tomllib  # tomli on Python 3.10
from minirl.errors import UserError
from minirl.observe.runs import status

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.toml"


@dataclass
class Run:
    """One run: its name, directory, records by step (ascending) and flattened config."""

    name: str
    path: str
    records: list[dict[str, Any]]  # each has "step"; ascending, one per step
    config: dict[str, Any] = field(default_factory=dict)  # "section.key" -> value; {} without config.toml
    status: dict[str, Any] | None = None  # status.json: how the run ended (minirl.observe.runs.status)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of `key` where it was logged and finite."""
        pairs = [(r["step"], r[key]) for r in self.records if r.get(key) is not None]
        return [s for s, _ in pairs], [float(v) for _, v in pairs]

    def stopped_short(self) -> str | None:
        """How far the run got and why, when that is short of trainer.total_training_steps."""
        total = self.config.get("trainer.total_training_steps")
        last = self.records[-1]["step"] if self.records else 0
        if isinstance(total, int) and last < total:
            return f"stopped at step {last} of {total} ({status.describe(self.status)})"
        return None


def warn(text: str) -> None:
    print(f"minirl: warning: {text}", file=sys.stderr, flush=True)


def read_run(path: str, name: str | None = None) -> Run:
    """Reads `path`/metrics.jsonl and `path`/config.toml (the latter optional, with a warning)."""
    metrics = os.path.join(path, METRICS_FILE)
    if not os.path.isfile(metrics):
        raise UserError(
            f"{path}: no {METRICS_FILE} there; give a run directory (runs/<experiment_name>) of a run "
            "whose trainer.logger includes 'jsonl'"
        )
    name = name or os.path.basename(os.path.normpath(path))
    config = read_config(os.path.join(path, CONFIG_FILE))
    return Run(name, path, read_metrics(metrics), config, status.read(path))


def read_metrics(path: str) -> list[dict[str, Any]]:
    """One record per step, ascending; unreadable lines skipped with a warning naming them."""
    by_step: dict[int, dict[str, Any]] = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            record = parse_line(line)
            if record is None:
                warn(f"{path} line {number}: not a whole JSON record with a 'step' (cut short?); skipped")
                continue
            by_step[record["step"]] = record  # a resumed run's re-done step replaces the earlier one
    return [by_step[s] for s in sorted(by_step)]


def parse_line(line: str) -> dict[str, Any] | None:
    """One metrics.jsonl record; None for a line that is not one (cut short by a crash)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        return None
    return record


def read_config(path: str) -> dict[str, Any]:
    """The flattened config ('section.key' -> value), or {} with a warning when missing or unreadable."""
    if not os.path.isfile(path):
        warn(f"{path}: missing; this run's config is left out of the config differences")
        return {}
    try:
        with open(path, "rb") as f:
            return flatten(tomllib.load(f))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        warn(f"{path}: not valid TOML ({exc}); this run's config is left out of the config differences")
        return {}


def parse_steps(spec: str) -> tuple[int, int | None]:
    """'2:' -> (2, None), '5:10' -> (5, 10), ':10' -> (0, 10), '7' -> (7, 7); both ends inclusive."""
    text = spec.strip()
    try:
        if ":" not in text:
            return int(text), int(text)
        lo, hi = text.split(":", 1)
        first, last = int(lo) if lo.strip() else 0, int(hi) if hi.strip() else None
    except ValueError:
        raise UserError(
            f"--steps {spec!r}: use FIRST:LAST (inclusive, either may be left out), e.g. 2: or 5:10"
        ) from None
    if first < 0 or (last is not None and last < first):
        raise UserError(f"--steps {spec!r}: FIRST must be >= 0 and LAST >= FIRST, e.g. 2: or 5:10")
    return first, last


def select(records: list[dict[str, Any]], steps: tuple[int, int | None]) -> list[dict[str, Any]]:
    first, last = steps
    return [r for r in records if r["step"] >= first and (last is None or r["step"] <= last)]


def config_differences(runs: list[Run]) -> list[tuple[str, list[Any]]]:
    """(key, each run's value or None) for every key whose value is not the same in all runs
    that have a config."""
    with_config = [r for r in runs if r.config]
    keys = sorted(set().union(*(r.config for r in with_config))) if with_config else []
    out = []
    for key in keys:
        values = [r.config.get(key) if r.config else None for r in runs]
        if len({repr(r.config.get(key)) for r in with_config}) > 1:
            out.append((key, values))
    return out


def logged_val_scores(run_dir: str, upto: int) -> list[tuple[int, float]]:
    """(step, val/score/mean) of what a resumed run logged up to its checkpoint's step, so that
    the end-of-run line shows the whole run; [] for a fresh run or one without the jsonl logger."""
    path = os.path.join(run_dir, METRICS_FILE)
    if upto == 0 or not os.path.isfile(path):
        return []
    scores = [(r["step"], r.get("val/score/mean")) for r in read_metrics(path) if r["step"] <= upto]
    return [(step, score) for step, score in scores if score is not None]
