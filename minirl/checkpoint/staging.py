"""Host copies of a checkpoint's model and optimizer state (trainer.async_save): once the copy
is made, training may change the live tensors while the copy is written.

The buffers are allocated at the first save and reused by every later one, keyed by the
tensor's place in the state tree: on CUDA they are pinned (page-locked), so the device-to-host
copy runs at the bus's speed instead of through a bounce buffer, and pinning (seconds for the
21 GB of the 1.5B actor with its AdamW state) happens once. A DTensor (an FSDP2 shard) is copied as a
DTensor with the same mesh and placements whose local shard lives in host memory, so DCP writes
it exactly as it writes the live one. The cost: host memory equal to this rank's share of the
checkpoint, held for the whole run.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch

from minirl.errors import UserError

PIN_MIN_BYTES = 1 << 20  # smaller tensors (scalars, norms) are copied unpinned: pinning costs more


class HostStaging:
    """Copies a DCP state tree into host buffers that are reused from save to save."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pin = device.type == "cuda"
        self.buffers: dict[tuple, torch.Tensor] = {}  # path in the tree -> its host copy
        self.allocations = 0  # buffers allocated so far: the first save's count, unless shapes change

    def stage(self, tree: Any) -> Any:
        """`tree` with every tensor replaced by its host copy (other leaves deep-copied); returns
        once every copy is complete, so the caller may change the live tensors."""
        staged = self._copy(tree, ())
        if self.pin:
            torch.cuda.synchronize(self.device)  # the non-blocking device-to-host copies
        return staged

    def _copy(self, node: Any, path: tuple) -> Any:
        if isinstance(node, dict):
            return {key: self._copy(value, (*path, key)) for key, value in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(self._copy(value, (*path, i)) for i, value in enumerate(node))
        if torch.is_tensor(node):
            return self._tensor(node, path)
        return copy.deepcopy(node)

    def _tensor(self, live: torch.Tensor, path: tuple) -> torch.Tensor:
        staged = self.buffers.get(path)
        if staged is not None and _same_layout(staged, live):
            _local(staged).copy_(_local(live).detach(), non_blocking=self.pin)
            return staged
        # the first save: a copy that a DTensor makes as a DTensor of the same mesh and placements
        # with its local shard on the host (what torch's own staging does), then page-locked
        staged = self.buffers[path] = live.detach().to("cpu", copy=True)
        if self.pin and _local(staged).nbytes >= PIN_MIN_BYTES:
            _pin(staged)
        self.allocations += 1
        return staged


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _same_layout(staged: torch.Tensor, live: torch.Tensor) -> bool:
    if type(staged) is not type(live) or staged.shape != live.shape or staged.dtype != live.dtype:
        return False
    if hasattr(live, "placements") and tuple(staged.placements) != tuple(live.placements):
        return False
    return _local(staged).shape == _local(live).shape


def _pin(staged: torch.Tensor) -> None:
    """Page-lock the host copy where it is (exactly its size: the pinned-memory allocator would
    round each tensor up to a power of two); unlocked when the copy is freed."""
    local = _local(staged)
    cudart = torch.cuda.cudart()
    code = int(cudart.cudaHostRegister(local.data_ptr(), local.nbytes, 0))
    if code != 0:
        raise UserError(
            f"trainer.async_save: page-locking {local.nbytes / 1e9:.2f} GB of host memory for the checkpoint's "
            f"copy failed (CUDA error {code}); free host memory, or set trainer.async_save = false (each save "
            "then blocks training until it is on disk)"
        )
    weakref.finalize(staged, cudart.cudaHostUnregister, local.data_ptr()).atexit = False
