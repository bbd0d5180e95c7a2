"""Launchers: how the ranks of a job are started, and how a rank's end is told to the user.

A launcher is a registered component (`minirl_launchers` hook): launcher(cfg, pm, job) -> exit
status, where job(cfg, pm, dist) is what each rank runs. Built in: `local` and `torchrun`
(minirl.dist.launchers.local) and, as a plugin, `ray` (minirl_plugins.launchers.ray). Every
launcher ends in `minirl.dist.spmd.init_from_env`: from there on the code is the same. A worker
turns its exception into a `Report`, and the launcher prints the first failed rank's once.
"""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass

from minirl.errors import Stopped, UserError

AUTO = "auto"
EXIT_CRASH, EXIT_USER_ERROR = 1, 2


def ray_address(trainer_cfg) -> str:
    """The Ray cluster to use: trainer.ray_address, else RAY_ADDRESS ("" for none)."""
    return trainer_cfg.ray_address or os.environ.get("RAY_ADDRESS", "")


def choose(trainer_cfg) -> tuple[str, str]:
    """(launcher name, why) for trainer.launcher; "auto" picks torchrun under torchrun, ray for
    several nodes or a Ray address, else local."""
    from minirl.dist.spmd import under_torchrun

    t = trainer_cfg
    if t.launcher != AUTO:
        return t.launcher, f"trainer.launcher = {t.launcher!r}"
    if under_torchrun():
        return "torchrun", "RANK and WORLD_SIZE are set (torchrun)"
    if t.nnodes > 1:
        return "ray", f"trainer.nnodes = {t.nnodes}"
    if t.ray_address:
        return "ray", f"trainer.ray_address = {t.ray_address!r}"
    if os.environ.get("RAY_ADDRESS"):
        return "ray", f"RAY_ADDRESS = {os.environ['RAY_ADDRESS']!r}"
    return "local", "one machine"


def launch(cfg, pm, job) -> int:
    """Run job(cfg, pm, dist) on every rank with the chosen launcher; returns the exit status
    (0, 1 for a crash, 2 for a user error, 128 + signal for a run stopped after its checkpoint)."""
    name, _ = choose(cfg.trainer)
    return pm["launchers"].get(name)(cfg, pm, job)


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
