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
    """Worker processes of the job: torchrun's WORLD_SIZE, else GPUs of all nodes, else CPU processes.

    The local and torchrun launchers start exactly this many; the ray launcher with
    trainer.device = 'auto' learns the world from the cluster (minirl.validate.core.check_world)."""
    import os

    from minirl.dist.spmd import under_torchrun

    if under_torchrun():
        return int(os.environ["WORLD_SIZE"])
    device = cfg.trainer.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes if device == "cuda" else cfg.trainer.world_size
