"""`python -m tests.integration.crash_run <minirl arguments>`: `python -m minirl` whose process
SIGKILLs itself at a point named by MINIRL_TEST_CRASH, for the resume tests.

MINIRL_TEST_CRASH = "POINT:STEP[:RANK]", comma-separated for several; POINT is `after_step` (the
step's metrics logged, and a checkpoint still being written in the background finished first, so
that the newest complete checkpoint at the kill is the one the test expects) or `checkpoint`
(between the parameter and optimizer shards and the rest of ckpt_STEP, in the background write
when trainer.async_save). Without RANK every rank dies there. The patches are made at import: the local
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


def due(point: str, step: int) -> bool:
    rank = os.environ.get("RANK", "0")
    for item in os.environ.get(ENV, "").split(","):
        parts = item.strip().split(":")
        if parts[0] == point and int(parts[1]) == step and (len(parts) < 3 or parts[2] == rank):
            return True
    return False


def maybe_crash(point: str, step: int) -> None:
    if due(point, step):
        os.kill(os.getpid(), signal.SIGKILL)


def _log_then_crash(log):
    def patched(self, metrics, step):
        log(self, metrics, step)
        if due("after_step", step):
            self.checkpoints.wait()
        maybe_crash("after_step", step)

    return patched


def _shards_then_crash(dcp_save):
    def patched(state_dict, path, *rest):
        sums = dcp_save(state_dict, path, *rest)
        maybe_crash("checkpoint", int(os.path.basename(path).removeprefix(store.TMP_PREFIX)))
        return sums

    return patched


Trainer._log = _log_then_crash(Trainer._log)
state._dcp_save = _shards_then_crash(state._dcp_save)

if __name__ == "__main__":
    from minirl.cli import main

    sys.exit(main(sys.argv[1:]))
