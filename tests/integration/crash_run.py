"""`python -m tests.integration.crash_run <minirl arguments>`: `python -m minirl` whose process
SIGKILLs itself at a point named by MINIRL_TEST_CRASH, for the resume tests.

MINIRL_TEST_CRASH = "POINT:STEP[:RANK]", comma-separated for several; POINT is `after_step` (the
step's metrics logged) or `checkpoint` (between the parameter and optimizer shards and the rest
of ckpt_STEP). Without RANK every rank dies there. The patches are made at import: the local
launcher's spawned ranks import this main module again (as multiprocessing's __mp_main__), so
they carry them too.
"""

from __future__ import annotations

import os
import signal
import sys

from minirl.checkpoint import state, store
from minirl.trainer import Trainer

ENV = "MINIRL_TEST_CRASH"


def maybe_crash(point: str, step: int) -> None:
    rank = os.environ.get("RANK", "0")
    for item in os.environ.get(ENV, "").split(","):
        parts = item.strip().split(":")
        if parts[0] == point and int(parts[1]) == step and (len(parts) < 3 or parts[2] == rank):
            os.kill(os.getpid(), signal.SIGKILL)


def _log_then_crash(log):
    def patched(self, metrics, step):
        log(self, metrics, step)
        maybe_crash("after_step", step)

    return patched


def _shards_then_crash(dcp_save):
    def patched(parts, path, *rest):
        sums = dcp_save(parts, path, *rest)
        maybe_crash("checkpoint", int(os.path.basename(path).removeprefix(store.TMP_PREFIX)))
        return sums

    return patched


Trainer._log = _log_then_crash(Trainer._log)
state._dcp_save = _shards_then_crash(state._dcp_save)

if __name__ == "__main__":
    from minirl.cli import main

    sys.exit(main(sys.argv[1:]))
