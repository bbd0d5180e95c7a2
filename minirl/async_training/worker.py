"""A rollout rank of an asynchronous job: it generates and scores batches while the trainer
trains (docs/async.md has the admission rule, partial rollouts and the weight transfer).

Rank r of R works on groups r, r + R, ... of every batch, in index order, as far as the
admission rule allows; the batches run concurrently on one engine, and between engine steps the
rank loads a newly published weight version (with partial rollouts: at once, the requests in
flight keep their KV and go on with the new weights).
"""

from __future__ import annotations

import asyncio
import signal
import time

import torch

from minirl import build
from minirl.agent.loop import to_samples
from minirl.agent.server import request_level
from minirl.async_training.channel import Channel, Group, Part
from minirl.async_training.stamps import StampingServer
from minirl.config.load import Config
from minirl.data.prompts import PromptLoader, load_prompts
from minirl.dist.context import DistContext
from minirl.models.loading import load_model_for_rank
from minirl.observe import evaluate
from minirl.protocols import SamplingParams
from minirl.reward.manager import build_reward_manager
from minirl.reward.trajectory import training_scores
from minirl.rollout.trajectories import rollout_seed, sampling_params

POLL_S = 0.005


class RolloutWorker:
    def __init__(self, cfg: Config, pm, dist: DistContext):
        # the trainer drives the stop (its checkpoint first): a forwarded SIGTERM must not end us early
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.cfg, self.dist, self.channel = cfg, dist, Channel(dist.link)
        self.rank, self.ranks = dist.rollout_rank, cfg.rollout_world
        self.settings = cfg.async_training
        torch.manual_seed(cfg.trainer.seed + 7919 * (self.rank + 1))
        self.here = DistContext(device=dist.device)  # this rank alone: no collectives
        actor, self.tokenizer = load_model_for_rank(cfg.model, self.here, torch.float32)
        self.agents = build.agent_rollout(pm, cfg, self.tokenizer)
        records = load_prompts(cfg.data.train_files, self.tokenizer, cfg.data, self.agents.tool_schemas)
        self.loader = PromptLoader(records, cfg.data.train_batch_size, cfg.data.shuffle, cfg.data.seed)
        self.engine = request_level(build.engine(pm, cfg, actor, self.tokenizer, dist))
        del actor  # the engine holds its own copy; the trainer's weights replace it below
        self.dtype = cfg.engine_dtype(dist.device)
        self.rewards = build_reward_manager(
            cfg.reward, cfg.custom_reward_function, pm["reward_functions"], cfg.plugins.modules
        )
        # the validation prompts, when the run validates (the trainer then asks rollout rank 0)
        self.val = build.val_set(cfg.trainer, cfg.data, self.tokenizer, self.here, self.agents.tool_schemas)
        self.version, self.idle_s, self.stopping = 0, 0.0, False
        self.inflight: dict[int, asyncio.Task] = {}

    # ---------------------------------------------------------------------------------- the loop

    def run(self) -> None:
        try:
            self.load_weights(initial=True)  # the trainer's weights at its start (or resume)
            start = self.channel.wait_start()
            self.version = self.engine.weight_version = start.version
            self.next = start.index
            self.agents.event_loop.run_until_complete(self._main())
        finally:
            self.rewards.close()
            self.agents.close()
            self.channel.say_stopped()

    async def _main(self) -> None:
        self.server = StampingServer(self.engine, ordered=self.agents.cfg.multi_turn.deterministic)
        serving = asyncio.ensure_future(self.server.serve(self._between_steps))
        try:
            while not self.stopping:
                await self._serve_validation()
                self._admit()
                await self._wait_a_little()
                await self._sync_if_due()
                self.stopping = self.channel.stop_asked()
        finally:
            for task in self.inflight.values():
                task.cancel()
            await asyncio.gather(*self.inflight.values(), return_exceptions=True)
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)

    def _admit(self) -> None:
        """Start every batch the staleness bound allows (none while a validation is asked for)."""
        s = self.settings
        limit = batch_limit(self.version, s.staleness_threshold, s.trigger_parameter_sync_step)
        while self.next < limit and not (self.rank == 0 and self.channel.validation_asked()):
            self.inflight[self.next] = asyncio.ensure_future(self._batch(self.next))
            self.next += 1

    async def _wait_a_little(self) -> None:
        """Until a batch finishes or a moment passes; idle time counts when nothing is in flight."""
        start = time.monotonic()
        if self.inflight:
            done, _ = await asyncio.wait(list(self.inflight.values()), timeout=POLL_S * 4)
            for task in done:
                task.result()  # a failed batch fails the rank, with its own traceback
        else:
            await asyncio.sleep(POLL_S)
            self.idle_s += time.monotonic() - start
        self.inflight = {i: t for i, t in self.inflight.items() if not t.done()}

    # ---------------------------------------------------------------------------------- one batch

    async def _batch(self, index: int) -> None:
        start, version = time.monotonic(), self.version
        self.loader.drawn = index
        batch = self.loader.next_batch()
        records, n = batch[self.rank :: self.ranks], self.cfg.rollout.n  # this rank's groups of the batch
        expanded = [rec for rec in records for _ in range(n)]
        uids = [index * len(batch) + self.rank + self.ranks * g for g in range(len(records)) for _ in range(n)]
        samples = to_samples(expanded, uids, self._params(index), prefix=f"b{index}-")
        trajectories = await self.agents.run_batch(self.server, samples, [rec.agent_name for rec in expanded])
        versions = [self.server.take(s.request_id, t.response_mask) for s, t in zip(samples, trajectories)]
        scores, metrics = self._score(expanded, trajectories) if expanded else ([], {})
        groups = [
            Group(records[g], uids[g * n], trajectories[g * n : (g + 1) * n], versions[g * n : (g + 1) * n],
                  scores[g * n : (g + 1) * n], version)
            for g in range(len(records))
        ]  # fmt: skip
        tool_s = self.server.tools.so_far()
        self.channel.put_part(Part(index, self.rank, groups, metrics, time.monotonic() - start, self.idle_s, tool_s))

    def _params(self, index: int) -> SamplingParams:
        seed = rollout_seed(self.cfg.trainer.seed, index + 1, self.rank)
        return sampling_params(self.cfg.rollout, self.cfg.data.max_response_length, seed)

    def _score(self, records, trajectories) -> tuple[list[float], dict[str, float]]:
        """The trainer's score phase, here (this part's metrics; the trainer merges the parts')."""
        cpu, d = DistContext(device=torch.device("cpu")), self.cfg.data
        overlong = self.cfg.reward.overlong_buffer
        scores_B, metrics = training_scores(
            self.rewards, self.tokenizer, records, trajectories, overlong, d.max_response_length, cpu
        )
        return scores_B.tolist(), metrics

    # ---------------------------------------------------------------------------------- weights

    async def _between_steps(self) -> None:
        """Before each engine step: a published version is loaded now with partial rollouts."""
        if self.settings.partial_rollout and self.channel.version() > self.version:
            self.engine.pause_generation()
            self.load_weights()
            self.engine.continue_generation()

    async def _sync_if_due(self) -> None:
        """Between loop turns: load a published version once nothing is in flight (without
        partial rollouts, requests finish on the weights they started with)."""
        if self.channel.version() > self.version and (self.settings.partial_rollout or not self.engine.has_work()):
            if self.engine.has_work():
                self.engine.pause_generation()
                self.load_weights()
                self.engine.continue_generation()
            else:
                self.load_weights()

    def load_weights(self, initial: bool = False) -> None:
        """Receive the trainer's next weights (a broadcast: the trainer waits for every rollout
        rank here; one per published version, so the two sides stay in step), load them, and
        report their checksum for the trainer to compare."""
        key = "initial" if initial else str(self.version + 1)
        self.channel.say_ready(key)  # the trainer may send
        mb = self.cfg.rollout.update_weights_bucket_megabytes
        self.engine.load_weights(self.channel.receive_weights(self.dtype, mb))
        if not initial:
            self.version += 1
            self.engine.weight_version = self.version
        checksum = getattr(self.engine, "checksum", None)
        self.channel.put_checksum(key, self.rank, checksum(self.dtype) if checksum else None)

    # ---------------------------------------------------------------------------------- validation

    async def _serve_validation(self) -> None:
        """Rollout rank 0 answers the trainer's request (a version) once its engine is idle:
        greedy decoding (its own sampler) cannot share the engine with sampled requests."""
        if self.rank != 0 or self.val is None or not self.channel.validation_asked():
            return
        if self.version < self.channel.asked_version():
            return  # the weights it asks about are still to come: sync first
        while self.inflight or self.engine.has_work():
            await self._wait_a_little()
        version = self.channel.take_validation_request()
        records = self.val.records
        params = evaluate.greedy_params(self.cfg.data.max_response_length)
        samples = to_samples(records, list(range(len(records))), params, prefix="val-")
        trajectories = await self.agents.run_batch(self.server, samples, [r.agent_name for r in records])
        for s, t in zip(samples, trajectories):
            self.server.take(s.request_id, t.response_mask)  # validation tokens need no version
        out = evaluate.val_metrics(trajectories, self.rewards, self.tokenizer, self.val, self.here)
        self.channel.put_validation(version, out)


def batch_limit(version: int, staleness: int, trigger: int) -> int:
    """The first batch index a rollout rank holding weight `version` may not start yet. The
    trainer trains batch b at version b // trigger, so a batch started below this limit is at
    most `staleness` versions behind when it is trained (tests/unit/test_async.py proves it)."""
    return (version + staleness + 1) * trigger
