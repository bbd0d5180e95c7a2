"""`python -m minirl compare RUN_A RUN_B ...`: the end-of-run table, one column per run.

Rows: the end-of-run table's (minirl.observe.metrics.TABLE_ROWS), the train score and the last
validation score, each a run's mean over the chosen steps (default 2 on: step 1 is warm-up).
Every later run gets its relative difference to the first, marked better or worse; a metric a
run did not log is `—`. Below the table: the config keys whose values differ between the runs.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from typing import Any

from minirl.observe.metrics import TABLE_ROWS
from minirl.observe.runs.read import Run, config_differences, select

MISSING = "—"
# (label, key, unit, how the chosen steps become one number)
ROWS = tuple((label, key, unit, "mean") for label, key, unit, _ in TABLE_ROWS) + (
    ("score", "score/mean", "", "mean"),
    ("val score", "val/score/mean", "", "last"),
)


def direction(key: str) -> int:
    """+1 when higher is better, -1 when lower is better, 0 when neither."""
    if key.startswith("timing_s/"):
        return -1
    if key.startswith("perf/") or key in ("score/mean", "val/score/mean"):
        return +1
    return 0


@dataclass
class Row:
    label: str
    unit: str
    key: str
    values: list[float | None]  # one per run
    changes: list[float | None]  # relative to the first run, one per later run


def value_of(records: list[dict[str, Any]], key: str, how: str) -> float | None:
    """The mean (or the last) of `key` over the records that logged it (not null); None if none did."""
    values = [float(r[key]) for r in records if r.get(key) is not None]
    if not values:
        return None
    return values[-1] if how == "last" else sum(values) / len(values)


def relative(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return (value - base) / abs(base)


def build_rows(runs: list[Run], steps: tuple[int, int | None]) -> list[Row]:
    """One row per metric that at least one run logged."""
    chosen = [select(run.records, steps) for run in runs]
    rows = []
    for label, key, unit, how in ROWS:
        values = [value_of(records, key, how) for records in chosen]
        if all(v is None for v in values):
            continue
        rows.append(Row(label, unit, key, values, [relative(v, values[0]) for v in values[1:]]))
    return rows


def steps_note(runs: list[Run], steps: tuple[int, int | None]) -> str:
    first, last = steps
    span = f"{first}..{'last' if last is None else last}"
    counts = ", ".join(f"{run.name}: {len([r for r in select(run.records, steps) if r['step'] > 0])}" for run in runs)
    notes = [f"{run.name} {stopped}" for run in runs if (stopped := run.stopped_short())]
    return f"mean over steps {span} (training steps per run: {counts}); val score: the last in that range" + (
        "; " + "; ".join(notes) if notes else ""
    )


def fmt(value: float | None) -> str:
    return MISSING if value is None else f"{value:.4g}"


def fmt_change(row: Row, change: float | None) -> str:
    if change is None:
        return MISSING
    sign = direction(row.key) * change
    return f"{100 * change:+.1f}%" + (" better" if sign > 0 else " worse" if sign < 0 else "")


def fmt_config(value: Any, missing: str = MISSING) -> str:
    """As TOML writes it (true, not True), bare strings; an empty string as ""."""
    if value is None:
        return missing
    if isinstance(value, bool):
        return "true" if value else "false"
    return '""' if value == "" else str(value)


def table_cells(runs: list[Run], rows: list[Row]) -> tuple[list[str], list[list[str]]]:
    base = runs[0].name
    header = ["metric", "unit"] + [r.name for r in runs] + [f"{r.name} vs {base}" for r in runs[1:]]
    body = [
        [row.label, row.unit] + [fmt(v) for v in row.values] + [fmt_change(row, c) for c in row.changes] for row in rows
    ]
    return header, body


def render_text(runs: list[Run], steps: tuple[int, int | None]) -> str:
    header, body = table_cells(runs, build_rows(runs, steps))
    lines = _aligned([header] + body, first_rule=True)
    lines.append(f"({steps_note(runs, steps)})")
    diffs = config_differences(runs)
    if diffs:
        lines += ["", "config keys that differ:"]
        lines += _aligned([["  " + key] + [fmt_config(v) for v in values] for key, values in diffs], first_rule=False)
    return "\n".join(lines)


def _aligned(table: list[list[str]], first_rule: bool) -> list[str]:
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = [
        "  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in table
    ]
    lines = [line.rstrip() for line in lines]
    if first_rule:
        lines.insert(1, "-" * len(lines[0]))
    return lines


def render_markdown(runs: list[Run], steps: tuple[int, int | None]) -> str:
    header, body = table_cells(runs, build_rows(runs, steps))
    lines = _md_table(header, body, numeric_from=2)
    lines += ["", f"{steps_note(runs, steps)}."]
    diffs = config_differences(runs)
    if diffs:
        cfg_body = [[f"`{key}`"] + [fmt_config(v) for v in values] for key, values in diffs]
        lines += ["", "Config keys that differ:", ""] + _md_table(
            ["key"] + [r.name for r in runs], cfg_body, len(runs) + 1
        )
    return "\n".join(lines)


def _md_table(header: list[str], body: list[list[str]], numeric_from: int) -> list[str]:
    align = ["---" if i < numeric_from else "---:" for i in range(len(header))]
    return ["| " + " | ".join(cells) + " |" for cells in [header, align] + body]


def render_csv(runs: list[Run], steps: tuple[int, int | None]) -> str:
    """Numbers unrounded (relative differences in %), empty cells where missing; the differing
    config keys follow as rows whose unit is 'config'."""
    rows = build_rows(runs, steps)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["metric", "unit"] + [r.name for r in runs] + [f"{r.name} vs {runs[0].name} (%)" for r in runs[1:]])
    for row in rows:
        changes = ["" if c is None else repr(100 * c) for c in row.changes]
        writer.writerow([row.label, row.unit] + ["" if v is None else repr(v) for v in row.values] + changes)
    for key, values in config_differences(runs):
        writer.writerow([key, "config"] + [fmt_config(v, missing="") for v in values] + [""] * (len(runs) - 1))
    return out.getvalue()


RENDERERS = {"text": render_text, "markdown": render_markdown, "csv": render_csv}
