"""The built-in launchers of one machine: `local` (this process, or one spawned worker per
device) and `torchrun` (this process is one of torchrun's workers)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch

from minirl.dist import spmd
from minirl.dist.context import DistContext, resolve_device
from minirl.errors import Stopped, UserError
from minirl.dist.launchers.report import EXIT_USER_ERROR
from minirl.dist.launchers.spawn import spawn


def job_world(cfg) -> tuple[str, int]:
    """(device type, number of worker processes) that the config asks for on this machine."""
    t = cfg.trainer
    device = resolve_device(t.device).type
    if t.nnodes > 1:
        raise UserError(
            f"trainer.nnodes = {t.nnodes}: the local launcher starts the processes of one machine; "
            "use trainer.launcher = 'ray' (or 'auto') for several nodes, or torchrun on each node"
        )
    if device != "cuda":
        return device, t.world_size
    world = t.n_gpus_per_node
    if world > torch.cuda.device_count():
        raise UserError(
            f"trainer.n_gpus_per_node = {world}, but this machine has "
            f"{torch.cuda.device_count()} CUDA device(s); lower trainer.n_gpus_per_node"
        )
    return device, world


def launch_local(cfg, pm, job) -> int:
    """One worker per device (trainer.n_gpus_per_node on CUDA, trainer.world_size on CPU),
    supervised; one device runs in this process."""
    _, world = job_world(cfg)
    if world > 1:
        spmd.check_layout(cfg, world)  # fail once, here, rather than once per worker
        return spawn(_job_entry, world, (cfg, job))
    return run_in_place(cfg, pm, job, lambda: spmd.single_process(cfg))


def launch_torchrun(cfg, pm, job) -> int:
    """Under torchrun: RANK, WORLD_SIZE and the rest are set; this process is one rank."""
    if not spmd.under_torchrun():
        raise UserError(
            "trainer.launcher = 'torchrun', but RANK and WORLD_SIZE are not set: start the job with "
            "`torchrun --nproc_per_node G -m minirl ...`, or use trainer.launcher = 'auto'"
        )
    return run_in_place(cfg, pm, job, lambda: spmd.init_from_env(cfg))


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
