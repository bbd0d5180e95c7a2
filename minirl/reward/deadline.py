"""A time limit for a reward call run in the training process (reward.num_workers = 0).

On the main thread the call runs under a SIGALRM timer: at reward.timeout_s the signal handler
raises `CallTimeout` inside the call, at the next Python instruction or out of a blocking
system call (sleep, a socket, a pipe), and the call is abandoned. A CallTimeout is a
BaseException, so a reward function's `except Exception` cannot swallow it. What the timer
cannot stop is native code that never returns to Python (a C extension stuck in a loop): such
graders need reward.num_workers >= 1, where a call past its time has its process killed.

Off the main thread (signals reach only the main thread) the call runs on a daemon thread that
is abandoned at the deadline: the step goes on, the stuck thread is left behind.
"""

from __future__ import annotations

import signal
import threading
from typing import Any, Callable


class CallTimeout(BaseException):
    """Raised inside a reward call that ran past its time limit."""


def call_with_deadline(fn: Callable[[], Any], timeout_s: float) -> Any:
    """fn() or CallTimeout after timeout_s seconds."""
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        return _with_alarm(fn, timeout_s)
    return _on_a_thread(fn, timeout_s)


def _with_alarm(fn: Callable[[], Any], timeout_s: float) -> Any:
    def expire(signum, frame):
        raise CallTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _on_a_thread(fn: Callable[[], Any], timeout_s: float) -> Any:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True, name="minirl-reward-call")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise CallTimeout
    if "error" in box:
        raise box["error"]
    return box["value"]
