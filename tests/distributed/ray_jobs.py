"""Jobs for the ray launcher's tests: each rank records where it runs, or fails in one way.

Module level, so Ray's actors import them (this directory reaches them through PYTHONPATH,
which the launcher forwards). Results go to files under $MINIRL_TEST_OUT (MINIRL_* variables
are forwarded too).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from minirl.errors import UserError


def _out() -> Path:
    return Path(os.environ["MINIRL_TEST_OUT"])


def record(cfg, pm, dist) -> None:
    """Write this rank's environment, node and the sum of all ranks (one all-reduce)."""
    import ray

    total = dist.all_reduce(torch.tensor([float(dist.rank)]))
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR")
    seen = {k: os.environ[k] for k in keys}
    seen.update(node_id=ray.get_runtime_context().get_node_id(), rank_sum=total.item(), world=dist.world_size)
    (_out() / f"rank{dist.rank}.json").write_text(json.dumps(seen))


def user_error_on_rank1(cfg, pm, dist) -> None:
    """Rank 1 makes a user mistake while rank 0 waits for it in a collective."""
    if dist.rank == 1:
        raise UserError("data.train_files = []: list one or more parquet files")
    dist.all_reduce(torch.ones(1))


def exit_on_rank1(cfg, pm, dist) -> None:
    """Rank 1's process vanishes (no report) while rank 0 waits for it in a collective."""
    if dist.rank == 1:
        os._exit(1)
    dist.all_reduce(torch.ones(1))


def wait_forever(cfg, pm, dist) -> None:
    """Every rank says it is running, then waits (the test removes a node meanwhile)."""
    record(cfg, pm, dist)
    while True:
        time.sleep(0.2)
