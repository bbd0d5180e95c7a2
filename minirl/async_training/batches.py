"""The trainer's batch source in an asynchronous job: the rollout ranks' batches, in index order.

Trainer rank 0 joins the R parts of the next batch and drops the groups more than
async_training.staleness_threshold weight versions behind (counted; with the rollout's admission
rule none are, unless the settings changed on a resume), and hands every trainer rank its share.
The old log-probs are the behaviour policy's (the rollout engine's, verl's bypass mode), or with
compute_prox_log_prob the trainer's recomputed ones (docs/algorithms.md §5).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as tdist

from minirl.async_training.channel import Channel, Group
from minirl.batch import RolloutBatch
from minirl.observe.step_metrics import tool_time_metrics
from minirl.reward.manager import place_scores
from minirl.reward.metrics import merge_reward_metrics
from minirl.rollout.source import Rollout
from minirl.rollout.trajectories import model_tokens, to_batch


@dataclass
class Progress:
    """Where the trainer stands, saved in its checkpoints: the next batch index to take, the
    weight version of the last sync, and the steps since it."""

    next_index: int = 0
    version: int = 0
    since_sync: int = 0


@dataclass
class Taken:
    """What trainer rank 0 took for a step, for every trainer rank."""

    groups: list[Group]  # the kept ones, a multiple of the data-parallel size
    index: int  # the batch trained (after any that were dropped whole)
    dropped: int  # samples dropped as too stale
    reward_metrics: dict[str, float]
    idle_s: dict[int, float]  # rollout rank -> its idle seconds so far
    queue_depth: int  # batches finished and waiting
    tool_s: dict[int, tuple[float, float]]  # rollout rank -> its tool seconds so far, and its engine's idle ones


class RemoteBatches:
    sampled_by_current_weights = False  # the samples come from an older policy

    def __init__(self, channel: Channel, progress: Progress, cfg, dist, loader):
        self.channel, self.progress, self.dist, self.loader = channel, progress, dist, loader
        self.settings, self.rollout_cfg, self.ranks = cfg.async_training, cfg.rollout, cfg.rollout_world
        self.tis_cap, self.collective_timeout_s = cfg.actor.tis_imp_ratio_cap, cfg.trainer.collective_timeout_s
        self.idle_before: dict[int, float] = {}  # rollout rank -> its idle seconds at the last step
        self.tools_before: dict[int, tuple[float, float]] = {}  # and its tool seconds (Part.tool_s)
        self.multi_turn = cfg.rollout.multi_turn.enable
        self.old_log_probs_note = _old_log_probs_note(cfg.async_training)

    def next(self, step: int, timer) -> Rollout:
        """The next batch, this rank's share; the gen phase is the wait for it."""
        start = time.perf_counter()
        with timer.phase("gen"):
            taken = self._take()
        waited = time.perf_counter() - start
        per = len(taken.groups) // self.dist.dp_size
        batch = self._batch(taken.groups[self.dist.dp_rank * per : (self.dist.dp_rank + 1) * per])
        return Rollout(batch, taken.reward_metrics, model_tokens(batch.trajectories), self._metrics(taken, waited))

    def _batch(self, groups: list[Group]) -> RolloutBatch:
        n = self.rollout_cfg.n
        records, uids = [g.record for g in groups for _ in range(n)], [g.uid for g in groups for _ in range(n)]
        trajectories = [t for g in groups for t in g.trajectories]
        batch = to_batch(records, uids, trajectories, self.rollout_cfg, self.tis_cap, self.dist.device)
        scores = [s for g in groups for s in g.scores]
        batch.scores_B = torch.tensor(scores, dtype=torch.float32, device=self.dist.device)
        batch.token_scores_BT = place_scores(batch.scores_B, batch.mask_BT)
        if not self.settings.compute_prox_log_prob:  # bypass: the behaviour policy is the old one
            batch.old_log_probs_BT = batch.rollout_log_probs_BT
        return batch

    def _take(self) -> Taken:
        box = [self._take_on_rank0() if self.dist.is_main else None]
        if self.dist.world_size > 1:
            tdist.broadcast_object_list(box, src=0)
        return box[0]

    def _take_on_rank0(self) -> Taken:
        """Batches in index order until one keeps at least a group per data-parallel rank after
        the staleness check (every rank trains the same number of groups)."""
        dropped, rewards = 0, []
        while True:
            parts = [self.channel.take_part(self.progress.next_index, r) for r in range(self.ranks)]
            self.progress.next_index += 1
            self.loader.drawn = self.progress.next_index  # the data position: batches taken, trained or dropped
            groups = sorted((g for p in parts for g in p.groups), key=lambda g: g.uid)
            rewards.append(merge_reward_metrics([p.reward_metrics for p in parts if p.reward_metrics]))
            fresh = [g for g in groups if self._lag(g) <= self.settings.staleness_threshold]
            keep = len(fresh) - len(fresh) % self.dist.dp_size
            dropped += (len(groups) - keep) * self.rollout_cfg.n
            if keep:
                break
        idle, tools = {p.rank: p.idle_s for p in parts}, {p.rank: p.tool_s for p in parts}
        metrics = merge_reward_metrics([m for m in rewards if m])
        return Taken(fresh[:keep], self.progress.next_index - 1, dropped, metrics, idle, self._queue_depth(), tools)

    def _lag(self, group: Group) -> int:
        """Versions the group's oldest token is behind the weights about to be trained."""
        oldest = min(min(v) if v else group.version_start for v in group.versions)
        return self.progress.version - oldest

    def _queue_depth(self) -> int:
        """Rollout batches finished and waiting for the trainer."""
        s, first = self.settings, self.progress.next_index
        ahead = (s.staleness_threshold + 2) * s.trigger_parameter_sync_step
        return sum(self.channel.part_waiting(i, 0) for i in range(first, first + ahead))

    def _metrics(self, taken: Taken, waited: float) -> dict[str, float]:
        version, lags, partial = self.progress.version, [], 0
        for g in taken.groups:
            for v in g.versions:
                versions = v or [version]
                lags.append(version - min(versions))
                partial += max(versions) != min(versions)
        count = max(len(lags), 1)
        idle_s = sum(max(0.0, v - self.idle_before.get(r, 0.0)) for r, v in taken.idle_s.items())
        self.idle_before.update(taken.idle_s)
        tools = {} if not self.multi_turn else self._tool_metrics(taken.tool_s)
        return tools | {
            "async/version": float(version),
            "async/batch_index": float(taken.index),
            "async/staleness/mean": sum(lags) / count,
            "async/staleness/max": float(max(lags, default=0)),
            "async/partial_share": partial / count,
            "async/dropped_samples": float(taken.dropped),
            "async/queue_depth": float(taken.queue_depth),
            "async/rollout_idle_s": idle_s,  # summed over the rollout ranks, since the last step
            "async/trainer_idle_s": waited,  # the wait for this batch (timing_s/gen)
        }

    def _tool_metrics(self, tool_s: dict[int, tuple[float, float]]) -> dict[str, float]:
        """The rollout ranks' tool seconds since the last step (validation's included), and their
        engines' idle ones among them, summed over the ranks."""
        wall = idle = 0.0
        for r, (w, i) in tool_s.items():
            w0, i0 = self.tools_before.get(r, (0.0, 0.0))
            wall, idle = wall + max(0.0, w - w0), idle + max(0.0, i - i0)
        self.tools_before.update(tool_s)
        return tool_time_metrics(wall, idle)

    def validate(self) -> dict[str, float]:
        """Rollout rank 0 runs greedy validation at the current weights; the trainer waits."""
        box: list = [None]
        if self.dist.is_main:
            self.channel.ask_validation(self.progress.version)
            box[0] = self.channel.take_validation(self.progress.version)
        if self.dist.world_size > 1:
            tdist.broadcast_object_list(box, src=0)
        return box[0]

    def state_dict(self) -> dict:
        p = self.progress
        return {"async": {"next_index": p.next_index, "version": p.version, "since_sync": p.since_sync}}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("async")
        if saved:  # a resume: continue after the last batch the checkpoint trained on
            self.progress.next_index, self.progress.version = int(saved["next_index"]), int(saved["version"])
            self.progress.since_sync = int(saved.get("since_sync", 0))

    def close(self) -> None:
        """The rollout ranks stop and leave the link; trainer rank 0 (which serves it) waits for
        them, so that none loses its store mid-call."""
        if not self.dist.is_main or not self.channel.link:
            return
        self.channel.stop()
        deadline = time.monotonic() + self.collective_timeout_s
        while self.channel.stopped() < self.ranks and time.monotonic() < deadline:
            time.sleep(0.01)


def _old_log_probs_note(a) -> str:
    how = "the trainer's proximal pass" if a.compute_prox_log_prob else "the rollout engine's (behaviour policy)"
    return (
        f"{how}; asynchronous: staleness <= {a.staleness_threshold}, weights synced every "
        f"{a.trigger_parameter_sync_step} step(s), partial rollouts {'on' if a.partial_rollout else 'off'}"
    )
