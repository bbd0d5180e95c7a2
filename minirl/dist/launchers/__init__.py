"""Launchers: how the ranks of a job are started. Every rank then runs the same job.

A launcher is a registered component (`minirl_launchers` hook): launcher(cfg, pm, job) -> exit
status, where job(cfg, pm, dist) is what each rank runs. Built in: `local` (this process, or one
spawned worker per device of this machine; minirl.dist.launchers.local), `torchrun` (this process is
one of torchrun's workers) and, as a plugin, `ray` (several nodes; minirl_plugins.launchers.ray).

Every launcher ends in `minirl.dist.spmd.init_from_env`: from there on the code is the same.
"""

from __future__ import annotations

import os

AUTO = "auto"


def ray_address(trainer_cfg) -> str:
    """The Ray cluster to use: trainer.ray_address, else RAY_ADDRESS ("" for none)."""
    return trainer_cfg.ray_address or os.environ.get("RAY_ADDRESS", "")


def choose(trainer_cfg) -> tuple[str, str]:
    """(launcher name, why) for trainer.launcher; "auto" picks torchrun under torchrun, ray for
    several nodes or a Ray address, else local."""
    from minirl.dist.spmd import under_torchrun

    t = trainer_cfg
    if t.launcher != AUTO:
        return t.launcher, f"trainer.launcher = {t.launcher!r}"
    if under_torchrun():
        return "torchrun", "RANK and WORLD_SIZE are set (torchrun)"
    if t.nnodes > 1:
        return "ray", f"trainer.nnodes = {t.nnodes}"
    if t.ray_address:
        return "ray", f"trainer.ray_address = {t.ray_address!r}"
    if os.environ.get("RAY_ADDRESS"):
        return "ray", f"RAY_ADDRESS = {os.environ['RAY_ADDRESS']!r}"
    return "local", "one machine"


def launch(cfg, pm, job) -> int:
    """Run job(cfg, pm, dist) on every rank with the chosen launcher; returns the exit status
    (0, 1 for a crash, 2 for a user error, 128 + signal for a run stopped after its checkpoint)."""
    name, _ = choose(cfg.trainer)
    return pm["launchers"].get(name)(cfg, pm, job)
