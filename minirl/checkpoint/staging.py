"""Host copies of a checkpoint's model and optimizer state (trainer.async_save): once the copy
is made, training may change the live tensors while the copy is written.

One host buffer per tensor, keyed by the tensor's place in the state tree, reused by every
save. They are made ahead of the first save (`prepare`, called by the trainer after the first
step, once the AdamW state exists): empty buffers of each local shard's shape and dtype, then,
on a background thread while training goes on, page-locked on CUDA (cudaHostRegister, which
also touches every page: seconds for the 21 GB of the 1.5B actor with its AdamW state). So even
the first save only copies, at the bus's speed, instead of copying through a bounce buffer and
then pinning (16.7 s on an H200). A tensor without a prepared buffer (a save before `prepare`,
a changed shape or layout) gets one at the save: allocated empty, pinned, then copied into, so
the copy is a pinned one too. A DTensor (an FSDP2 shard) is copied into a DTensor with the same
mesh and placements whose local shard lives in host memory, so DCP writes it exactly as it
writes the live one. The cost: host memory equal to this rank's share of the checkpoint, held
for the whole run: from the first step on when prepared, from the first save otherwise.
"""

from __future__ import annotations

import copy
import weakref
from concurrent.futures import Future
from typing import Any, Callable

import torch

from minirl.errors import UserError

PIN_MIN_BYTES = 1 << 20  # smaller tensors (scalars, norms) are copied unpinned: pinning costs more


class HostStaging:
    """Copies a DCP state tree into host buffers that are reused from save to save."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pin = device.type == "cuda"
        self.buffers: dict[tuple, torch.Tensor] = {}  # path in the tree -> its host copy
        self.allocations = 0  # buffers allocated so far: the prepared (or first save's) count, unless shapes change
        self._preparing: Future | None = None  # the page-locking of the prepared buffers

    def prepare(self, tree: Any, submit: Callable[..., Future]) -> None:
        """Make the host buffer of every tensor of `tree` now (empty: no copy, no page touched)
        and page-lock them through `submit` (a background thread), so that the first save only
        copies. Its error is raised by the next `stage` (or `join`)."""
        fresh = []
        _map_tensors(tree, (), lambda live, path: fresh.append(self._allocate(live, path)))
        if self.pin:
            self._preparing = submit(_pin_on, self.device, fresh)

    def join(self) -> None:
        """Wait for `prepare`'s page-locking; raises its error (once)."""
        preparing, self._preparing = self._preparing, None
        if preparing is not None:
            preparing.result()

    def stage(self, tree: Any) -> Any:
        """`tree` with every tensor replaced by its host copy (other leaves deep-copied); returns
        once every copy is complete, so the caller may change the live tensors."""
        self.join()
        staged = _map_tensors(tree, (), self._tensor)
        if self.pin:
            torch.cuda.synchronize(self.device)  # the non-blocking device-to-host copies
        return staged

    def _tensor(self, live: torch.Tensor, path: tuple) -> torch.Tensor:
        staged = self.buffers.get(path)
        if staged is None or not _same_layout(staged, live):  # not prepared: pinned before the copy
            staged = self._allocate(live, path)
            if self.pin:
                _pin_all([staged])
        _local(staged).copy_(_local(live).detach(), non_blocking=self.pin)
        return staged

    def _allocate(self, live: torch.Tensor, path: tuple) -> torch.Tensor:
        """An empty host buffer for `live`; a DTensor's is a DTensor of the same mesh and
        placements with its local shard on the host (what torch's own staging does)."""
        staged = self.buffers[path] = torch.empty_like(live.detach(), device="cpu")
        self.allocations += 1
        return staged


def _map_tensors(node: Any, path: tuple, fn: Callable[[torch.Tensor, tuple], Any]) -> Any:
    """`node` with every tensor replaced by fn(tensor, its path in the tree: the buffers' key)
    and every other leaf deep-copied."""
    if isinstance(node, dict):
        return {key: _map_tensors(value, (*path, key), fn) for key, value in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_map_tensors(value, (*path, i), fn) for i, value in enumerate(node))
    if torch.is_tensor(node):
        return fn(node, path)
    return copy.deepcopy(node)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _same_layout(staged: torch.Tensor, live: torch.Tensor) -> bool:
    if type(staged) is not type(live) or staged.shape != live.shape or staged.dtype != live.dtype:
        return False
    if hasattr(live, "placements") and tuple(staged.placements) != tuple(live.placements):
        return False
    return _local(staged).shape == _local(live).shape


def _pin_on(device: torch.device, buffers: list[torch.Tensor]) -> None:
    """`_pin_all` on another thread: whose current GPU is GPU 0, not this rank's, and memory is
    pinned for the context that registers it."""
    with torch.cuda.device(device):
        _pin_all(buffers)


def _pin_all(buffers: list[torch.Tensor]) -> None:
    """Page-lock every buffer of at least PIN_MIN_BYTES."""
    for staged in buffers:
        if _local(staged).nbytes >= PIN_MIN_BYTES:
            _pin(staged)


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
