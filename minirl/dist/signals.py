"""Stopping on SIGTERM / SIGINT: finish the current step, write a checkpoint, exit non-zero.

Schedulers (SLURM, Kubernetes) send SIGTERM some time before they kill; Ctrl-C sends SIGINT. The
first signal only sets a flag; the loop looks at it after each step, all ranks agree (one tiny
all-reduce, since a signal may reach the ranks at different moments), and the trainer saves and
raises `Stopped`. A second signal, a second or more after the first, exits at once. A signal
delivered twice within that second counts once: a scheduler that signals every process and our
supervisor forwarding the same signal must not look like an impatient user.
"""

from __future__ import annotations

import abc
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as tdist

REPEAT_WINDOW_S = 1.0
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class SignalHandler(abc.ABC):
    """Context manager base: `_handle(signum, frame)` handles SIGTERM and SIGINT inside the
    `with` block (main thread only: Python delivers signals there), and the previous handlers
    come back on exit. The trainer, the spawn supervisor and the Ray driver subclass it."""

    def __enter__(self):
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @abc.abstractmethod
    def _handle(self, signum: int, frame) -> None:
        """Called (in the main thread) on SIGTERM or SIGINT inside the `with` block."""


class StopRequest(SignalHandler):
    """Turns the first SIGTERM/SIGINT into a request the loop honours."""

    def __init__(self):
        self.signum: int | None = None
        self._first_at = 0.0

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self.signum is None:
            self.signum, self._first_at = signum, now
            print(
                f"minirl: got {signal.Signals(signum).name}: finishing this step, then a checkpoint "
                "(send it again to stop at once)",
                file=sys.stderr,
                flush=True,
            )
        elif now - self._first_at >= REPEAT_WINDOW_S:
            print(f"minirl: second {signal.Signals(signum).name}: stopping now", file=sys.stderr, flush=True)
            os._exit(128 + signum)

    def agreed(self, device: torch.device) -> int | None:
        """The signal number if any rank was signalled (a collective: every rank must call)."""
        local = -1 if self.signum is None else self.signum
        if tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1:
            t = torch.tensor([local], device=device)
            tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
            local = int(t.item())
        return None if local < 0 else local
