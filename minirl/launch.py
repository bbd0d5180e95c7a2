"""Start a job: in-process on one device or CPU.

Multi-process start (one worker per GPU, or `trainer.world_size` CPU workers) is added by the
scale-out work; one process is the embedded default.
"""

from __future__ import annotations

import sys

from minirl.dist import DistContext, resolve_device
from minirl.errors import UserError


def launch(cfg, pm) -> int:
    dist = DistContext(device=resolve_device(cfg.trainer.device))
    return run_worker(cfg, pm, dist)


def run_worker(cfg, pm, dist: DistContext) -> int:
    from minirl.trainer import Trainer

    try:
        Trainer(cfg, pm, dist).fit()
    except UserError as exc:
        print(f"minirl: error: {exc}", file=sys.stderr)
        return 2
    return 0
