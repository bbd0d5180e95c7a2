"""Asynchronous off-policy training (docs/async.md): rollout ranks that generate while the
trainer ranks train. The trainer is the collocated one with another batch source and weight
sync (`remote`); `worker` is a rollout rank's loop; `channel` the messages between them."""

from __future__ import annotations

from minirl.async_training.batches import Progress, RemoteBatches
from minirl.async_training.broadcast import Broadcast
from minirl.async_training.channel import Channel


def remote(parts) -> tuple[RemoteBatches, Broadcast]:
    """The trainer's batch source and weight sync (minirl.rollout.source) of an asynchronous
    job; they share where the run stands (the next batch, the weight version)."""
    channel, progress = Channel(parts.dist.link), Progress()
    source = RemoteBatches(channel, progress, parts.cfg, parts.dist, parts.loader)
    return source, Broadcast(channel, progress, parts.adapter, parts.cfg, parts.dist)
