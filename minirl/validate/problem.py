"""What the rules of the validation pass share: the Problem each one reports, a key's value and
the number of worker processes. Every rule module imports this one and none imports
minirl.validate.core: no import circle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from minirl.config.load import Config


@dataclass(frozen=True)
class Problem:
    """One invalid value: `key = value (origin): rule; fix`."""

    key: str
    value: Any
    rule: str
    fix: str


def value(cfg: Config, key: str) -> Any:
    """cfg's value of a dotted key: value(cfg, "actor.optim.lr")."""
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def world_size(cfg: Config) -> int:
    """Worker processes that train: torchrun's WORLD_SIZE, else GPUs of all nodes, else CPU processes
    (an asynchronous job's rollout ranks not counted).

    The local and torchrun launchers start exactly this many; the ray launcher with
    trainer.device = 'auto' learns the world from the cluster (minirl.validate.core.check_world)."""
    import os

    from minirl.dist.spmd import under_torchrun

    if under_torchrun():
        return int(os.environ["WORLD_SIZE"]) - cfg.rollout_world
    device = cfg.trainer.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    t, rollout = cfg.trainer, cfg.rollout_world
    # an asynchronous job's rollout ranks do not train: they come on top of the trainer's GPUs,
    # and on CPU (or under torchrun) they are the last of the processes
    return t.n_gpus_per_node * t.nnodes if device == "cuda" else t.world_size - rollout
