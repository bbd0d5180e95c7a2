"""The messages between the trainer and the rollout ranks of an asynchronous job: one dataclass per
payload, one method per message, every key spelled here only. The transport is minirl.dist.link
(a TCPStore for the messages, a process group for the weights); each method is called by one
side only, the trainer (its rank 0) or a rollout rank, as its section says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

from minirl.dist.link import Link
from minirl.models.checksum import weights_checksum
from minirl.protocols import Trajectory


@dataclass
class Start:
    index: int  # the first batch the rollout ranks generate
    version: int  # the weight version they hold


@dataclass
class Group:
    """One prompt's rollout.n samples, generated and scored on a rollout rank."""

    record: Any  # minirl.data.prompts.PromptRecord
    uid: int
    trajectories: list[Trajectory]
    versions: list[list[int]]  # per trajectory, per response token: the weight version that sampled it
    scores: list[float]
    version_start: int  # the version its rank held when the batch started


@dataclass
class Checksum:
    value: int | None  # a rollout rank's engine after a weight load (None: the engine computes none)


@dataclass
class Part:
    """A rollout rank's share of one batch: its groups r, r + R, ... of batch `index`."""

    index: int
    rank: int
    groups: list[Group]
    reward_metrics: dict[str, float]  # over this part (the trainer merges the parts')
    gen_s: float
    idle_s: float  # the rank's idle seconds so far
    tool_s: tuple[float, float] = (0.0, 0.0)  # seconds with a tool call out so far, the engine idle in them


class Channel:
    def __init__(self, link: Link):
        self.link = link

    # ------------------------------------------------------------------ start and stop

    def start(self, start: Start) -> None:
        """Trainer: where the rollout ranks begin (the version counter starts there too)."""
        self.link.count("version", start.version)
        self.link.put("async/start", start)

    def wait_start(self) -> Start:
        """Rollout rank."""
        return self.link.wait_take_shared("async/start")

    def stop(self) -> None:
        """Trainer: ask the rollout ranks to stop."""
        self.link.count("async/stop", 1)

    def stop_asked(self) -> bool:
        """Rollout rank."""
        return self.link.count("async/stop") > 0

    def say_stopped(self) -> None:
        """Rollout rank: it is leaving the link."""
        self.link.count("async/stopped", 1)

    def stopped(self) -> int:
        """Trainer: the rollout ranks that left."""
        return self.link.count("async/stopped")

    # ------------------------------------------------------------------ batches

    def put_part(self, part: Part) -> None:
        """Rollout rank."""
        self.link.put(_part_key(part.index, part.rank), part)

    def take_part(self, index: int, rank: int) -> Part:
        """Trainer: waits as long as it takes (the launcher watches the rollout rank)."""
        what = f"rollout rank {rank}'s part of batch {index}"
        return self.link.wait_take(_part_key(index, rank), what, timeout_s=None)

    def part_waiting(self, index: int, rank: int) -> bool:
        """Trainer: the part is finished and not yet taken."""
        return self.link.store.check([_part_key(index, rank)])

    # ------------------------------------------------------------------ weights

    def publish_version(self) -> None:
        """Trainer: a new weight version is coming."""
        self.link.publish_version()

    def version(self) -> int:
        """Rollout rank: the latest version the trainer published."""
        return self.link.version()

    def say_ready(self, key: str) -> None:
        """Rollout rank: it listens for the weights `key` ("initial", or a version)."""
        self.link.count(f"weights/ready/{key}", 1)

    def ready(self, key: str) -> int:
        """Trainer: the rollout ranks listening for the weights `key`."""
        return self.link.count(f"weights/ready/{key}")

    def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, bucket_mb: int) -> dict:
        """Trainer: the broadcast (minirl.dist.link.Link.send_weights), with the sent weights' checksum."""
        return self.link.send_weights(weights, dtype, bucket_mb, weights_checksum)

    def receive_weights(self, dtype: torch.dtype, bucket_mb: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Rollout rank."""
        return self.link.receive_weights(dtype, bucket_mb)

    def put_checksum(self, key: str, rank: int, checksum: int | None) -> None:
        """Rollout rank: its engine's checksum after loading the weights `key` (None: the engine has none)."""
        self.link.put(f"weights/checksum/{key}/{rank}", Checksum(checksum))

    def take_checksum(self, key: str, rank: int) -> int | None:
        """Trainer."""
        what = f"rollout rank {rank}'s weight checksum"
        return self.link.wait_take(f"weights/checksum/{key}/{rank}", what).value

    # ------------------------------------------------------------------ validation

    def ask_validation(self, version: int) -> None:
        """Trainer: rollout rank 0 validates at weight `version`."""
        self.link.put("val/request", version)

    def validation_asked(self) -> bool:
        """Rollout rank 0."""
        return self.link.store.check(["val/request"])

    def asked_version(self) -> int:
        """Rollout rank 0: the version asked about (the request stays)."""
        return self.link.wait_take_shared("val/request")

    def take_validation_request(self) -> int:
        """Rollout rank 0."""
        return self.link.take("val/request")

    def put_validation(self, version: int, metrics: dict[str, float]) -> None:
        """Rollout rank 0."""
        self.link.put(f"val/result/{version}", metrics)

    def take_validation(self, version: int) -> dict[str, float]:
        """Trainer: waits as long as the validation takes."""
        return self.link.wait_take(f"val/result/{version}", "the rollout's validation", timeout_s=None)


def _part_key(index: int, rank: int) -> str:
    return f"batch/{index}/{rank}"
