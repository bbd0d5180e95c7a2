"""The trainer's weight sync in an asynchronous job: every trigger_parameter_sync_step steps a new
weight version, broadcast from trainer rank 0 to every rollout rank in the engines' dtype, then
each engine's checksum must equal the sender's."""

from __future__ import annotations

import time

from minirl.async_training.batches import Progress
from minirl.async_training.channel import Channel, Start


class Broadcast:
    def __init__(self, channel: Channel, progress: Progress, adapter, cfg, dist):
        self.channel, self.progress, self.adapter, self.dist = channel, progress, adapter, dist
        self.trigger, self.ranks = cfg.async_training.trigger_parameter_sync_step, cfg.rollout_world
        self.dtype, self.bucket_mb = cfg.engine_dtype(dist.device), cfg.rollout.update_weights_bucket_megabytes

    def start(self, resumed: bool) -> None:
        """Tell the rollout ranks where to start (the next batch, the weight version), then give
        them the weights (a resumed run's, restored)."""
        if self.dist.is_main:
            self.channel.start(Start(self.progress.next_index, self.progress.version))
        self._send("initial")

    def after_update(self) -> dict[str, float]:
        p = self.progress
        p.since_sync += 1
        if p.since_sync < self.trigger:
            return {"timing_s/weight_transfer": 0.0}
        p.since_sync = 0
        p.version += 1
        return self._send(str(p.version))

    def _send(self, key: str) -> dict[str, float]:
        """The actor's full weights (every trainer rank gathers its shards) from trainer rank 0."""
        weights = self.adapter.engine_weights()
        if not self.dist.is_main:
            for _ in weights:  # the gathers are collectives of the trainer ranks
                pass
            return {}
        if key != "initial":
            self.channel.publish_version()
        # every rollout rank says it is ready first: one without partial rollouts finishes its
        # requests before it listens, which may take longer than a collective's timeout
        while self.channel.ready(key) < self.ranks:
            time.sleep(0.002)
        sent = self.channel.send_weights(weights, self.dtype, self.bucket_mb)
        for r in range(self.ranks):
            got = self.channel.take_checksum(key, r)
            if got is not None and got != sent["checksum"]:
                raise RuntimeError(
                    f"rollout rank {r} holds weights with checksum {got} after sync {key}, the trainer sent "
                    f"{sent['checksum']}: the weight transfer is broken"
                )
        return {"timing_s/weight_transfer": sent["seconds"], "async/weight_transfer_gb": sent["bytes"] / 1e9}
