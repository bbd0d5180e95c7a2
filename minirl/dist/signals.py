"""Stopping on SIGTERM / SIGINT: finish the current step, write a checkpoint, exit 128 + signal.

The first signal only sets a flag; after each step the ranks agree on it (one all-reduce: a
signal may reach them at different moments), and the trainer saves and raises `Stopped`. A
second signal, a second or more after the first, exits at once; one delivered twice within that
second (by the scheduler to every process and by our forwarding) counts once.
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
    """Inside its `with` block, SIGTERM and SIGINT call `_request` (main thread only: Python
    delivers signals there); the previous handlers come back on exit. `signum` is the first
    signal, `count` the requests so far; a repeat within `repeat_window_s` of the first is not
    counted (see the module doc). The trainer, the spawn supervisor and the Ray driver subclass it."""

    repeat_window_s = REPEAT_WINDOW_S

    def __init__(self):
        self.signum: int | None = None
        self.count, self._first_at = 0, 0.0

    def __enter__(self):
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self.count and now - self._first_at < self.repeat_window_s:
            return
        if not self.count:
            self.signum, self._first_at = signum, now
        self.count += 1
        self._request(signum)

    @abc.abstractmethod
    def _request(self, signum: int) -> None:
        """Called (in the main thread) for each counted signal; `self.count` says which one."""


class StopRequest(SignalHandler):
    """Turns the first SIGTERM/SIGINT into a request the loop honours; a second exits at once."""

    def _request(self, signum: int) -> None:
        if self.count > 1:
            print(f"minirl: second {signal.Signals(signum).name}: stopping now", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        text = f"got {self.name}: finishing this step, then a checkpoint (send it again to stop at once)"
        print(f"minirl: {text}", file=sys.stderr, flush=True)

    def agreed(self, device: torch.device) -> int | None:
        """The signal number if any rank was signalled (a collective: every rank must call)."""
        local = -1 if self.signum is None else self.signum
        if tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1:
            t = torch.tensor([local], device=device)
            tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
            local = int(t.item())
        return None if local < 0 else local
