"""`python -m async_crash <minirl arguments>`: `python -m minirl` whose ranks SIGKILL themselves at a
point named by MINIRL_TEST_ASYNC: "rollout:K" (a rollout rank, once it has put batch K on the
link) or "trainer:K:RANK" (a trainer rank, after step K). The local launcher's workers import this
main module again (multiprocessing's __mp_main__), so they carry the patches."""

from __future__ import annotations

import os
import signal
import sys

from minirl.async_training.worker import RolloutWorker
from minirl.trainer import Trainer

WHERE = os.environ.get("MINIRL_TEST_ASYNC", "")


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _patched_batch(batch):
    async def patched(self, index):
        await batch(self, index)
        if WHERE == f"rollout:{index}":
            _kill()

    return patched


def _patched_step(train_step):
    def patched(self, step):
        metrics = train_step(self, step)
        if WHERE == f"trainer:{step}:{os.environ.get('RANK')}":
            _kill()
        return metrics

    return patched


RolloutWorker._batch = _patched_batch(RolloutWorker._batch)
Trainer.train_step = _patched_step(Trainer.train_step)

if __name__ == "__main__":
    from minirl.cli import main

    sys.exit(main(sys.argv[1:]))
