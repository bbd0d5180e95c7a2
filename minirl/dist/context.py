"""The process group as the training loop sees it: rank, world, device, and reductions.

Every batch-wide statistic goes through `DistContext.all_reduce` (a no-op at world size 1),
so the single-process loop and the SPMD loop are the same code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist


@dataclass
class DistContext:
    """This rank, the world, the (dp, sp) mesh and the device. minirl normalises every loss by
    global counts, so the gradient it wants is the SUM of the ranks' gradients: a data-parallel
    plugin must sum, not average (the FSDP2 plugin does)."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    mesh: Any = None
    sp_size: int = 1
    # asynchronous training (docs/async.md): "trainer" or "rollout" ("collocated" otherwise); the
    # trainer rank 0 and every rollout rank hold the link between the two groups
    role: str = "collocated"
    link: Any = None
    rollout_rank: int = -1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp_size

    @property
    def dp_group(self):
        return None if self.mesh is None else self.mesh["dp"].get_group()

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Sum (or max/min) over the data-parallel ranks; returns a new tensor. With the default
        sum it is the `Reducer` (minirl.protocols) the algorithm library takes."""
        if self.dp_size == 1 or not tdist.is_initialized():
            return x.clone()
        out = x.detach().clone()
        reduce_op = {"sum": tdist.ReduceOp.SUM, "max": tdist.ReduceOp.MAX, "min": tdist.ReduceOp.MIN}[op]
        tdist.all_reduce(out, op=reduce_op, group=self.dp_group)
        return out

    def max_over_ranks(self, n: int) -> int:
        """The largest n over the data-parallel ranks: counts of passes that must agree (FSDP)."""
        if self.dp_size == 1 or not tdist.is_initialized():
            return n  # no copy to the device and back: that would wait for its queued work
        return int(self.all_reduce(torch.tensor(n, device=self.device), "max"))

    def all_gather_objects(self, obj: Any) -> list[Any]:
        """Every data-parallel rank's `obj` (picklable), in rank order, on every rank."""
        if self.dp_size == 1 or not tdist.is_initialized():
            return [obj]
        out = [None] * self.dp_size
        tdist.all_gather_object(out, obj, group=self.dp_group)
        return out

    def sp_broadcast(self, obj: Any) -> Any:
        """The first sp rank's `obj` on every rank of its sp group. Ranks of an sp group must hold
        the same batch, and sampling on different GPUs need not be bit-identical."""
        if self.sp_size == 1 or not tdist.is_initialized():
            return obj
        box = [obj]
        tdist.broadcast_object_list(box, group=self.mesh["sp"].get_group(), group_src=0)
        return box[0]

    def barrier(self) -> None:
        if tdist.is_initialized():
            tdist.barrier()


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """trainer.device: auto picks CUDA when present."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", local_rank)
    return torch.device(name)
