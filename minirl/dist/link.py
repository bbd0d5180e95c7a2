"""The link between the trainer and the rollout ranks of an asynchronous job (docs/async.md).

Two channels, both apart from the trainer's own process group:
- a TCPStore served by the trainer rank 0 carries small messages: the weight version, each
  finished rollout batch (pickled, one key per batch index), validation results, idle seconds;
- a process group of its own (the trainer rank 0 is member 0, rollout rank i member i + 1; NCCL
  on CUDA, gloo on CPU) carries the weights, broadcast from the trainer in flat buckets.

Every call here is made by one side only, and every blocking wait has a timeout that names what
it waited for.
"""

from __future__ import annotations

import datetime
import os
import pickle
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist


def link_port() -> int:
    """The link's store port: MINIRL_LINK_PORT, else the job's MASTER_PORT + 1."""
    port = os.environ.get("MINIRL_LINK_PORT")
    return int(port) if port else int(os.environ["MASTER_PORT"]) + 1


@dataclass
class Link:
    store: Any
    group: Any  # the weights' process group
    member: int  # 0: the trainer rank 0; i + 1: rollout rank i
    members: int
    device: torch.device  # where the buckets travel: CUDA for NCCL, the CPU for gloo
    timeout_s: float

    @classmethod
    def connect(cls, member: int, rollout_ranks: int, device: torch.device, timeout_s: float) -> "Link":
        """Join the link (every trainer rank 0 and rollout rank calls this once, at start-up)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        members = rollout_ranks + 1
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        store = tdist.TCPStore(host, link_port(), members, member == 0, timeout=timeout)
        prefixed = tdist.PrefixStore("weights", store)
        if device.type == "cuda":
            options = tdist.ProcessGroupNCCL.Options()
            options._timeout = timeout  # trainer.collective_timeout_s, as the trainer's own collectives
            group = tdist.ProcessGroupNCCL(prefixed, member, members, options)
            bucket_device = device
        else:
            group = tdist.ProcessGroupGloo(prefixed, member, members, timeout)
            bucket_device = torch.device("cpu")
        return cls(store, group, member, members, bucket_device, timeout_s)

    # ------------------------------------------------------------------------- control messages

    def version(self) -> int:
        """The weight version the trainer has published (0 before its first sync)."""
        return int(self.store.add("version", 0))

    def publish_version(self) -> int:
        return int(self.store.add("version", 1))

    def put(self, key: str, value: Any) -> None:
        self.store.set(key, pickle.dumps(value))

    def take(self, key: str) -> Any | None:
        """The value under key, removed; None when there is none (yet)."""
        if not self.store.check([key]):
            return None
        value = pickle.loads(self.store.get(key))
        self.store.delete_key(key)
        return value

    def wait_take(self, key: str, what: str, timeout_s: float | None = -1.0, poll_s: float = 0.002) -> Any:
        """take(key), waiting for it at most timeout_s (-1: the link's, trainer.collective_timeout_s;
        None: as long as it takes: a rollout batch, whose producer the launcher watches)."""
        limit = self.timeout_s if timeout_s == -1.0 else timeout_s
        start = time.monotonic()
        while True:
            value = self.take(key)
            if value is not None:
                return value
            if limit is not None and time.monotonic() - start > limit:
                raise TimeoutError(f"waited {limit:.0f} s for {what} (trainer.collective_timeout_s)")
            time.sleep(min(poll_s * (1 + (time.monotonic() - start)), 0.05))

    def count(self, key: str, add: int = 0) -> int:
        return int(self.store.add(key, add))

    # ------------------------------------------------------------------------- weights

    def send_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, bucket_mb: int, checksum: Callable
    ) -> dict:
        """Broadcast (name, tensor) from the trainer (member 0) in buckets of at most bucket_mb MiB
        (one tensor may exceed it), in `dtype`; the names and shapes go first, through the store.
        Returns the seconds it took, the bytes and checksum(the sent tensors, dtype)."""
        start = time.perf_counter()
        tensors = [(name, t.detach().to(self.device, dtype)) for name, t in weights]
        meta = [(name, tuple(t.shape)) for name, t in tensors]
        self.put("weights/meta", meta)
        for bucket in buckets(meta, dtype, bucket_mb):
            flat = torch.cat([tensors[i][1].reshape(-1) for i in bucket]) if bucket else torch.empty(0)
            self._broadcast(flat)
        total = checksum(tensors, dtype)
        nbytes = sum(t.numel() for _, t in tensors) * dtype.itemsize
        return {"seconds": time.perf_counter() - start, "bytes": nbytes, "checksum": total}

    def receive_weights(self, dtype: torch.dtype, bucket_mb: int) -> Iterator[tuple[str, torch.Tensor]]:
        """The trainer's weights, bucket by bucket (views into each received bucket: copy them
        before asking for the next), on a rollout rank."""
        meta = self.wait_take_shared("weights/meta")
        for bucket in buckets(meta, dtype, bucket_mb):
            sizes = [_numel(meta[i][1]) for i in bucket]
            flat = torch.empty(sum(sizes), dtype=dtype, device=self.device)
            self._broadcast(flat)
            for i, piece in zip(bucket, flat.split(sizes)):
                yield meta[i][0], piece.view(meta[i][1])

    def wait_take_shared(self, key: str) -> Any:
        """A value every rollout rank reads (the trainer removes it before the next one)."""
        self.store.wait([key], datetime.timedelta(seconds=self.timeout_s))
        return pickle.loads(self.store.get(key))

    def _broadcast(self, flat: torch.Tensor) -> None:
        opts = tdist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([flat], opts).wait()


def buckets(meta: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype, bucket_mb: int) -> list[list[int]]:
    """Indices of meta's tensors grouped in order into buckets of at most bucket_mb MiB (a tensor
    larger than that is a bucket of its own); both sides compute the same grouping."""
    limit, out, size = bucket_mb << 20, [], 0
    for i, (_, shape) in enumerate(meta):
        nbytes = _numel(shape) * dtype.itemsize
        if not out or size + nbytes > limit:
            out.append([])
            size = 0
        out[-1].append(i)
        size += nbytes
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
