"""The `compare` and `report` subcommands of python -m minirl: arguments in, runs read, output out."""

from __future__ import annotations

import argparse
import os

from minirl.errors import UserError
from minirl.observe.runs.read import Run, parse_steps, read_run

COMPARE_HELP = "the end-of-run table of several runs side by side, with differences and differing config keys"
REPORT_HELP = "PNG figures of one or more runs' curves (score, length, KL, grad norm, phase times, throughput)"


def _parser(command: str, description: str, names: str, steps: str, steps_help: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m minirl {command}", description=description)
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories (each with metrics.jsonl)")
    p.add_argument("--names", help=f"comma-separated {names} names, one per run (default: directory names)")
    p.add_argument("--steps", default=steps, help=f"FIRST:LAST, inclusive, either end optional ({steps_help})")
    return p


def read_runs(paths: list[str], names: str | None) -> list[Run]:
    labels = [n.strip() for n in names.split(",")] if names else [None] * len(paths)
    if len(labels) != len(paths):
        raise UserError(f"--names {names!r} gives {len(labels)} names for {len(paths)} runs; give one per run")
    runs = [read_run(path, label) for path, label in zip(paths, labels)]
    _disambiguate(runs)
    return runs


def _disambiguate(runs: list[Run]) -> None:
    """Two runs with one directory name (a/grpo, b/grpo) get their parent's name in front."""
    names = [run.name for run in runs]
    for run in runs:
        if names.count(run.name) > 1:
            parent = os.path.basename(os.path.dirname(os.path.abspath(run.path)))
            run.name = f"{parent}/{run.name}"


def compare_main(argv: list[str]) -> int:
    from minirl.observe.runs.compare import RENDERERS

    p = _parser("compare", COMPARE_HELP, "column", "2:", "default 2: step 1 is warm-up")
    p.add_argument("--format", choices=sorted(RENDERERS), default="text")
    args = p.parse_args(argv)
    steps = parse_steps(args.steps)
    runs = read_runs(args.runs, args.names)
    print(RENDERERS[args.format](runs, steps), end="" if args.format == "csv" else "\n")
    return 0


def report_main(argv: list[str]) -> int:
    from minirl.observe.runs.read import select
    from minirl.observe.runs.report import figure_class, write_report

    p = _parser("report", REPORT_HELP, "legend", "0:", "default: all")
    p.add_argument("--out", help="directory for the PNGs (default: RUN/figures for one run, ./figures for several)")
    args = p.parse_args(argv)
    figure_class()  # the missing extra is reported before any file is read
    steps = parse_steps(args.steps)
    runs = read_runs(args.runs, args.names)
    for run in runs:
        run.records = select(run.records, steps)
    out = args.out or (os.path.join(args.runs[0], "figures") if len(runs) == 1 else "figures")
    for path in write_report(runs, out):
        print(path)
    return 0


COMMANDS = {"compare": (compare_main, COMPARE_HELP), "report": (report_main, REPORT_HELP)}
