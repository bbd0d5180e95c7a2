"""How a rank's end is told to the user, the same for every launcher.

A worker turns its exception into a `Report` (kind, text, exit code); the launcher prints the
report of the first failed rank once: a user error as one line, a crash with its traceback, a
run stopped by a signal as its one line with exit status 128 + signal.
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass

from minirl.errors import Stopped, UserError

EXIT_CRASH, EXIT_USER_ERROR = 1, 2


@dataclass(frozen=True)
class Report:
    """kind: user | crash | peer (a collective that lost its peer) | died (no report: the process
    or its node died) | stopped (a signal, after the checkpoint)."""

    kind: str
    text: str
    exit_code: int


def report_of(exc: BaseException) -> Report:
    """The report of the exception a rank's job raised (inside an `except` block)."""
    if isinstance(exc, UserError):
        return Report("user", str(exc), EXIT_USER_ERROR)
    if isinstance(exc, Stopped):
        return Report("stopped", str(exc), exc.exit_code)
    kind = "peer" if lost_peer(exc) else "crash"
    return Report(kind, traceback.format_exc(), EXIT_CRASH)


def lost_peer(exc: BaseException) -> bool:
    """A collective that failed because another rank went away: a consequence, not the cause, so
    a launcher that sees one waits a moment for the report of the rank that caused it."""
    import torch.distributed as tdist

    text = str(exc)
    if isinstance(exc, getattr(tdist, "DistNetworkError", ())):
        return True
    return "gloo" in text and ("Connection closed by peer" in text or "Connection reset by peer" in text)


def print_report(rank: int, report: Report) -> int:
    """Print the failed (or stopped) rank's report once; returns the job's exit status."""
    text = {
        "stopped": report.text,
        "user": f"error: (rank {rank}) {report.text}",
        "died": f"worker rank {rank} died: {report.text}; all workers stopped",
    }.get(report.kind, f"worker rank {rank} failed; all workers stopped. Its traceback:\n{report.text}")
    print(f"minirl: {text}", file=sys.stderr, flush=True)
    return report.exit_code
