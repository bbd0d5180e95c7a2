"""How a run ended, kept in its directory (status.json, rank 0 writes it), so that `compare` can
tell a finished run from one stopped by a signal with a checkpoint to resume from, one that
crashed, and one that may still be running.

The trainer writes "running" (with its process id and host) when it starts, then "finished",
"stopped" (the signal and the checkpoint it wrote) or "crashed" (the error's first line) when it
ends. A process killed outright (kill -9, the OOM killer) writes nothing more: its "running"
names a process that no longer exists, which a reader on the same host can see.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

STATUS_FILE = "status.json"


def write(run_dir: str, state: str, step: int, **fields: Any) -> None:
    """Replace run_dir/status.json atomically; an I/O error here never stops a run."""
    record = {"state": state, "step": step, "pid": os.getpid(), "host": socket.gethostname(), **fields}
    path = os.path.join(run_dir, STATUS_FILE)
    try:
        os.makedirs(run_dir, exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)
    except OSError:
        pass


class RunStatus:
    """One run's status.json as the trainer moves through it (rank 0 writes; on other ranks every
    call does nothing), and the run's last line."""

    def __init__(self, run_dir: str, is_main: bool, checkpoint: str | None = None):
        self.run_dir, self.is_main, self.checkpoint = run_dir, is_main, checkpoint

    def update(self, state: str, step: int, **fields: Any) -> None:
        if self.is_main:
            write(self.run_dir, state, step, checkpoint=self.checkpoint, **fields)

    def saved(self, step: int, path: str) -> None:
        """A checkpoint is complete: a run killed from now on resumes from it."""
        self.checkpoint = path
        self.update("running", step)

    def end_line(self, files: list[str]) -> str:
        """Where the run's output is: `files` (metrics.jsonl, config.toml, ...) and the newest
        checkpoint, with the command that turns it into a Hugging Face directory."""
        line = f"run directory: {self.run_dir} ({', '.join(files)}"
        if not self.checkpoint:
            return line + ")"
        ckpt = os.path.basename(self.checkpoint)
        export = f"python -m minirl export --checkpoint {self.checkpoint} --out DIR"
        return f"{line}, newest checkpoint {ckpt}: {export} makes it a Hugging Face directory)"


def read(run_dir: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(run_dir, STATUS_FILE)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "state" in record else None


def describe(status: dict[str, Any] | None) -> str:
    """Why a run's metrics stop where they do, in a few words."""
    if status is None:
        return "no status.json (a run of an older minirl): still running, or crashed"
    state = status["state"]
    if state == "finished":
        return "finished"
    if state == "stopped":
        ckpt = status.get("checkpoint")
        resume = f"resumable from {ckpt}" if ckpt else "no checkpoint to resume from"
        return f"stopped by {status.get('signal', 'a signal')}; {resume}"
    last = f"; the newest checkpoint: {status['checkpoint']}" if status.get("checkpoint") else ""
    if state == "crashed":
        return f"crashed: {status.get('error', 'an error')}{last}"
    return _running(status) + last


def _running(status: dict[str, Any]) -> str:
    """'running' as written at the start: the process, if it is on this host, says which."""
    pid, host = status.get("pid"), status.get("host")
    if host != socket.gethostname():
        return f"running on {host} (process {pid}), or killed there"
    if isinstance(pid, int) and _alive(pid):
        return f"still running (process {pid})"
    return f"killed (process {pid} is gone: kill -9, out of memory, or a second Ctrl-C)"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
