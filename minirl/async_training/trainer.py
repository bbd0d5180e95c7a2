"""The trainer ranks of an asynchronous job: the training loop, fed by the rollout ranks.

A step takes the next rollout batch in index order from the link (the trainer rank 0 waits for
it and hands every trainer rank its share), drops the groups that are more than
async_training.staleness_threshold weight versions behind (counted; none are with the rollout's
admission rule unless the settings changed on a resume), trains on the rest exactly as the
synchronous loop does, and every trigger_parameter_sync_step steps publishes a new weight
version and broadcasts the weights to the rollout ranks (minirl.dist.link), checking that each
engine then holds exactly what was sent.

The old log-probs are the behaviour policy's, the rollout engine's own (use_rollout_log_probs,
verl's bypass mode), or with compute_prox_log_prob the trainer's recomputed ones at the current
weights (the proximal policy of decoupled PPO) with the truncated importance weight
min(exp(lp_prox - lp_behaviour), actor.tis_imp_ratio_cap) on the loss (docs/algorithms.md §5).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as tdist

from minirl.async_training.channel import Channel, Start
from minirl.observe.metrics import PhaseTimer
from minirl.reward.manager import place_scores
from minirl.reward.metrics import merge_reward_metrics
from minirl.rollout.trajectories import model_tokens, to_batch
from minirl.trainer import Trainer


class AsyncTrainer(Trainer):
    def __init__(self, cfg, pm, dist):
        self.channel, self.a = Channel(dist.link), cfg.async_training
        self.started, self.since_sync, self.version, self.next_index = False, 0, 0, 0
        self.step_metrics: dict[str, float] = {}
        self._idle_before: dict[int, float] = {}  # rollout rank -> its idle seconds at the last step
        super().__init__(cfg, pm, dist)
        saved = self.state.extra.get("async")
        if saved:  # a resume: continue after the last batch the checkpoint trained on
            self.next_index, self.version = int(saved["next_index"]), int(saved["version"])
            self.since_sync = int(saved.get("since_sync", 0))

    # ------------------------------------------------------------------------------- the hooks

    def build_engine(self):
        return None  # the rollout ranks hold the engines

    def is_on_policy(self) -> bool:
        return False  # the samples come from an older policy: the old log-probs are never the update's

    def next_prompts(self):
        return None  # the rollout ranks draw the prompts

    def fit(self):
        try:
            self.start_rollouts()
            return super().fit()
        finally:
            self.stop_rollouts()

    def train_step(self, records, step: int) -> dict[str, float]:
        metrics = super().train_step(records, step)
        metrics.update(self.step_metrics)
        return metrics

    def save(self, step: int) -> str:
        self.loader.drawn = self.next_index  # the data position: batches taken (trained or dropped)
        self.state.extra["async"] = {
            "next_index": self.next_index,
            "version": self.version,
            "since_sync": self.since_sync,
        }
        return super().save(step)

    # ------------------------------------------------------------------------------- batches in

    def rollout(self, records, step: int, timer: PhaseTimer):
        """The next rollout batch (the gen phase is the trainer's wait for it), this rank's share."""
        start = time.perf_counter()
        with timer.phase("gen"):
            groups, info = self._take_groups()
        info["trainer_idle_s"] = time.perf_counter() - start
        n, dp, rank = self.cfg.rollout.n, self.dist.dp_size, self.dist.dp_rank
        per = len(groups) // dp
        mine = groups[rank * per : (rank + 1) * per]
        expanded = [g.record for g in mine for _ in range(n)]
        uids = [g.uid for g in mine for _ in range(n)]
        trajectories = [t for g in mine for t in g.trajectories]
        r, cap = self.cfg.rollout, self.cfg.actor.tis_imp_ratio_cap
        batch = to_batch(expanded, uids, trajectories, r, cap, self.dist.device)
        scores = [s for g in mine for s in g.scores]
        batch.scores_B = torch.tensor(scores, dtype=torch.float32, device=self.dist.device)
        batch.token_scores_BT = place_scores(batch.scores_B, batch.mask_BT)
        self.step_metrics = self._stale_metrics(groups, info)
        generated = model_tokens(trajectories)
        return batch, info["reward_metrics"], generated

    def _take_groups(self) -> tuple[list[dict], dict]:
        """The trainer rank 0 takes batches in index order until one keeps at least a group per
        data-parallel rank after the staleness check, and hands the kept groups to every rank."""
        box: list = [None]
        if self.dist.is_main:
            dropped, payloads = 0, []
            while True:
                payload = self._join_parts(self.next_index)
                self.next_index += 1
                payloads.append(payload)
                fresh = [g for g in payload["groups"] if self._lag(g) <= self.a.staleness_threshold]
                keep = len(fresh) - len(fresh) % self.dist.dp_size  # every rank trains the same number of groups
                dropped += (len(payload["groups"]) - keep) * self.cfg.rollout.n
                if keep:
                    break
            info = {
                "index": self.next_index - 1,  # the batch trained (after any that were dropped whole)
                "dropped": dropped,
                "reward_metrics": merge_reward_metrics([p["reward_metrics"] for p in payloads if p["reward_metrics"]]),
                "rollout_idle_s": payloads[-1]["rollout_idle_s"],
                "queue_depth": self._queue_depth(),
            }
            box[0] = (fresh[:keep], info)
        if self.dist.world_size > 1:
            tdist.broadcast_object_list(box, src=0)
        return box[0]

    def _join_parts(self, index: int) -> dict:
        """Batch `index`: the groups of its R parts (one per rollout rank), in batch order."""
        parts = [self.channel.take_part(index, r) for r in range(self._rollout_ranks())]
        return {
            "index": index,
            "groups": sorted((g for p in parts for g in p.groups), key=lambda g: g.uid),
            "reward_metrics": merge_reward_metrics([p.reward_metrics for p in parts if p.reward_metrics]),
            "rollout_idle_s": {p.rank: p.idle_s for p in parts},
        }

    def _lag(self, group) -> int:
        """Versions the group's oldest token is behind the weights about to be trained."""
        oldest = min(min(v) if v else group.version_start for v in group.versions)
        return self.version - oldest

    def _queue_depth(self) -> int:
        """Rollout batches finished and waiting for the trainer."""
        ahead = (self.a.staleness_threshold + 2) * self.a.trigger_parameter_sync_step
        return sum(self.channel.part_waiting(i, 0) for i in range(self.next_index, self.next_index + ahead))

    def _stale_metrics(self, groups: list[dict], info: dict) -> dict[str, float]:
        lags, partial = [], 0
        for g in groups:
            for v in g.versions:
                versions = v or [self.version]
                lags.append(self.version - min(versions))
                partial += max(versions) != min(versions)
        count = max(len(lags), 1)
        idle = info["rollout_idle_s"]  # rollout rank -> its idle seconds so far
        idle_s = sum(max(0.0, v - self._idle_before.get(r, 0.0)) for r, v in idle.items())
        self._idle_before.update(idle)
        return {
            "async/version": float(self.version),
            "async/batch_index": float(info["index"]),
            "async/staleness/mean": sum(lags) / count,
            "async/staleness/max": float(max(lags, default=0)),
            "async/partial_share": partial / count,
            "async/dropped_samples": float(info["dropped"]),
            "async/queue_depth": float(info["queue_depth"]),
            "async/rollout_idle_s": idle_s,  # summed over the rollout ranks, since the last step
            "async/trainer_idle_s": info["trainer_idle_s"],  # the wait for this batch (timing_s/gen)
        }

    def _old_source(self) -> str:
        a = self.a
        how = "the trainer's proximal pass" if a.compute_prox_log_prob else "the rollout engine's (behaviour policy)"
        return (
            f"{how}; asynchronous: staleness <= {a.staleness_threshold}, weights synced every "
            f"{a.trigger_parameter_sync_step} step(s), partial rollouts {'on' if a.partial_rollout else 'off'}"
        )

    def old_log_probs(self, batch) -> torch.Tensor:
        """The behaviour policy's log-probs (the rollout engine's), or the proximal policy's."""
        if self.a.compute_prox_log_prob:
            return super().old_log_probs(batch)
        return batch.rollout_log_probs_BT

    # ------------------------------------------------------------------------------- weights out

    def start_rollouts(self) -> None:
        """Tell the rollout ranks where to start (the next batch, the weight version), then give
        them the weights (a resumed run's, restored)."""
        if self.dist.is_main:
            self.channel.start(Start(self.next_index, self.version))
        self._broadcast("initial")
        self.started = True

    def sync_weights(self) -> None:
        """Every trigger_parameter_sync_step steps: a new version for the rollout ranks."""
        if not self.started:
            return  # a resume's restore: start_rollouts sends those weights
        self.since_sync += 1
        if self.since_sync < self.a.trigger_parameter_sync_step:
            self.step_metrics["timing_s/weight_transfer"] = 0.0
            return
        self.since_sync = 0
        self.version += 1
        self._broadcast(str(self.version))

    def _broadcast(self, key: str) -> None:
        """The actor's full weights (every trainer rank gathers its shards) from the trainer rank 0
        to every rollout rank, in the engines' dtype; then each engine's checksum must match."""
        weights = self.adapter.engine_weights()
        if not self.dist.is_main:
            for _ in weights:  # the gathers are collectives of the trainer ranks
                pass
            return
        if key != "initial":
            self.channel.publish_version()
        # every rollout rank says it is ready first: one without partial rollouts finishes its
        # requests before it listens, which may take longer than a collective's timeout
        while self.channel.ready(key) < self._rollout_ranks():
            time.sleep(0.002)
        mb = self.cfg.rollout.update_weights_bucket_megabytes
        sent = self.channel.send_weights(weights, self.cfg.engine_dtype(self.dist.device), mb)
        for r in range(self._rollout_ranks()):
            got = self.channel.take_checksum(key, r)
            if got is not None and got != sent["checksum"]:
                raise RuntimeError(
                    f"rollout rank {r} holds weights with checksum {got} after sync {key}, the trainer sent "
                    f"{sent['checksum']}: the weight transfer is broken"
                )
        self.step_metrics["timing_s/weight_transfer"] = sent["seconds"]
        self.step_metrics["async/weight_transfer_gb"] = sent["bytes"] / 1e9

    def _rollout_ranks(self) -> int:
        return self.cfg.rollout_world

    # ------------------------------------------------------------------------------- the rest

    def validate(self) -> dict[str, float]:
        """Rollout rank 0 runs greedy validation at the current weights; the trainer waits."""
        box: list = [None]
        if self.dist.is_main:
            self.channel.ask_validation(self.version)
            box[0] = self.channel.take_validation(self.version)
        if self.dist.world_size > 1:
            tdist.broadcast_object_list(box, src=0)
        return box[0]

    def stop_rollouts(self) -> None:
        """The rollout ranks stop and leave the link; the trainer rank 0 (which serves it) waits
        for them, so that none loses its store mid-call."""
        if not self.dist.is_main or not self.channel.link:
            return
        self.channel.stop()
        deadline = time.monotonic() + self.cfg.trainer.collective_timeout_s
        while self.channel.stopped() < self._rollout_ranks() and time.monotonic() < deadline:
            time.sleep(0.01)
