"""The built-in launchers of one machine: `local` (this process, or one spawned worker per
device) and `torchrun` (this process is one of torchrun's workers)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import NoReturn

import torch

from minirl.dist import spmd
from minirl.dist.context import DistContext, resolve_device
from minirl.dist.launchers import EXIT_USER_ERROR
from minirl.dist.launchers.spawn import leave, spawn
from minirl.errors import Stopped, UserError


def launch_local(cfg, pm, job) -> int:
    """One worker per device (trainer.n_gpus_per_node on CUDA, trainer.world_size on CPU),
    supervised; one device runs in this process."""
    t = cfg.trainer
    cuda = resolve_device(t.device).type == "cuda"
    # an asynchronous job's rollout GPUs come on top of the trainer's (on CPU: among world_size)
    world = t.n_gpus_per_node + cfg.rollout_world if cuda else t.world_size
    # validation refuses several nodes and more GPUs than this machine has
    assert t.nnodes == 1 and (not cuda or world <= torch.cuda.device_count())
    if world > 1:
        return spawn(_job_entry, world, (cfg, job))
    return run_in_place(cfg, pm, job, lambda: spmd.single_process(cfg))


def launch_torchrun(cfg, pm, job) -> NoReturn:
    """Under torchrun: RANK, WORLD_SIZE and the rest are set; this process is one rank, which
    leaves as a spawned worker does (spawn.leave: no interpreter teardown after the job)."""
    # the environment is a fact of the process that runs the job, not of the config, so it is
    # checked here, where it is read
    if not spmd.under_torchrun():
        raise UserError(
            "trainer.launcher = 'torchrun', but RANK and WORLD_SIZE are not set: start the job with "
            "`torchrun --nproc_per_node G -m minirl ...`, or use trainer.launcher = 'auto'"
        )
    leave(run_in_place(cfg, pm, job, lambda: spmd.init_from_env(cfg)))


def run_in_place(cfg, pm, job, make_dist: Callable[[], DistContext]) -> int:
    try:
        dist = make_dist()
        job(cfg, pm, dist)
    except UserError as exc:
        prefix = f"(rank {os.environ['RANK']}) " if spmd.under_torchrun() else ""
        print(f"minirl: error: {prefix}{exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except Stopped as exc:
        if not spmd.under_torchrun() or os.environ["RANK"] == "0":
            print(f"minirl: {exc}", file=sys.stderr)
        return exc.exit_code
    finally:
        spmd.shutdown()
    return 0


def _job_entry(rank: int, cfg, job) -> None:
    from minirl.plugins import PluginManager

    dist = spmd.init_from_env(cfg)
    try:
        job(cfg, PluginManager(cfg.plugins.modules), dist)
    finally:
        spmd.shutdown()
