"""Crash injection for the resume tests: the process SIGKILLs itself at a named point.

MINIRL_TEST_CRASH = "POINT:STEP[:RANK]", comma-separated for several; POINT is `after_step` (its
metrics logged) or `checkpoint` (between the parameter and optimizer shards and the rest).
Without RANK every rank dies there; unset, nothing happens.
"""

from __future__ import annotations

import os
import signal

ENV = "MINIRL_TEST_CRASH"


def maybe_crash(point: str, step: int) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    rank = os.environ.get("RANK", "0")
    for item in spec.split(","):
        parts = item.strip().split(":")
        if parts[0] == point and int(parts[1]) == step and (len(parts) < 3 or parts[2] == rank):
            os.kill(os.getpid(), signal.SIGKILL)
