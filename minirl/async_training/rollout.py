"""A rollout rank of an asynchronous job: it generates and scores batches while the trainer trains.

The global sequence of prompt batches (the loader's order, epoch after epoch) is shared by
index: every rollout rank works on every batch, rank r of R on the batch's prompt groups r,
r + R, ... (so all ranks are busy whatever the staleness, and each holds 1/R of a batch's KV
cache); the trainer joins the R parts of a batch. Batch b may start only while
b < (v + staleness_threshold + 1) * trigger_parameter_sync_step, v the weight version the rank
holds: a sample is then never more than staleness_threshold versions behind when the trainer
takes it (0: each batch waits for the weights of the update before it, 1: one-step off-policy).
Batches run concurrently on one engine (minirl.agent: one agent loop per sample, one shared
EngineServer). Between engine steps the rank looks for a new weight version: with
partial_rollout it pauses the engine, loads the new weights and continues the requests in
flight (their KV kept; the tokens after the load carry the new version), without it it first
lets them finish. A finished batch is scored here and put on the link for the trainer.
"""

from __future__ import annotations

import asyncio
import signal
import time

import torch

from minirl import build
from minirl.agent.loop import to_samples
from minirl.agent.server import EngineServer, request_level
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
        self.cfg, self.dist, self.link = cfg, dist, dist.link
        self.r, self.R = dist.rollout_rank, cfg.rollout_world
        self.a = cfg.async_training
        torch.manual_seed(cfg.trainer.seed + 7919 * (self.r + 1))
        actor, self.tokenizer = load_model_for_rank(cfg.model, DistContext(device=dist.device), torch.float32)
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
        self.val = build.val_set(
            cfg.trainer, cfg.data, self.tokenizer, DistContext(device=dist.device), self.agents.tool_schemas
        )
        self.version, self.idle_s, self.stopping = 0, 0.0, False
        self.inflight: dict[int, asyncio.Task] = {}

    # ---------------------------------------------------------------------------------- the loop

    def run(self) -> None:
        try:
            self.load_weights(initial=True)  # the trainer's weights at its start (or resume)
            start = self.link.wait_take_shared("async/start")  # {"index": next batch, "version": v}
            self.version = self.engine.weight_version = start["version"]
            self.next = start["index"]
            self.agents.event_loop.run_until_complete(self._main())
        finally:
            self.rewards.close()
            self.agents.close()
            self.link.count("async/stopped", 1)

    async def _main(self) -> None:
        self.server = EngineServer(self.engine, 0, ordered=self.agents.cfg.multi_turn.deterministic)
        serving = asyncio.ensure_future(self.server.serve(self._between_steps))
        try:
            while not self.stopping:
                await self._serve_validation()
                self._admit()
                await self._wait_a_little()
                await self._sync_if_due()
                self.stopping = self.link.count("async/stop") > 0
        finally:
            for task in self.inflight.values():
                task.cancel()
            await asyncio.gather(*self.inflight.values(), return_exceptions=True)
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)

    def _admit(self) -> None:
        """Start every batch the staleness bound allows (none while a validation is asked for)."""
        limit = batch_limit(self.version, self.a.staleness_threshold, self.a.trigger_parameter_sync_step)
        while self.next < limit and not (self.r == 0 and self.link.store.check(["val/request"])):
            index = self.next
            self.inflight[index] = asyncio.ensure_future(self._batch(index))
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
        records, n = batch[self.r :: self.R], self.cfg.rollout.n  # this rank's groups of the batch
        expanded = [rec for rec in records for _ in range(n)]
        uids = [index * len(batch) + self.r + self.R * g for g in range(len(records)) for _ in range(n)]
        samples = to_samples(expanded, uids, self._params(index), prefix=f"b{index}-")
        trajectories = await self.agents.run_batch(
            self.server, samples, [rec.agent_name for rec in expanded], versions=True
        )
        scores, metrics = self._score(expanded, trajectories) if expanded else ([], {})
        groups = [
            {"record": records[g], "uid": uids[g * n], "trajectories": trajectories[g * n : (g + 1) * n],
             "scores": scores[g * n : (g + 1) * n]}
            for g in range(len(records))
        ]  # fmt: skip
        payload = {
            "index": index,
            "rank": self.r,
            "groups": groups,
            "reward_metrics": metrics,
            "version_start": version,
            "gen_s": time.monotonic() - start,
            "rollout_idle_s": self.idle_s,
        }
        self.link.put(f"batch/{index}/{self.r}", payload)

    def _params(self, index: int) -> SamplingParams:
        seed = rollout_seed(self.cfg.trainer.seed, index + 1, self.r)
        return sampling_params(self.cfg.rollout, self.cfg.data.max_response_length, seed)

    def _score(self, records, trajectories) -> tuple[list[float], dict[str, float]]:
        """The trainer's score phase, here (this part's metrics; the trainer merges the parts')."""
        here = DistContext(device=torch.device("cpu"))
        max_len, overlong = self.cfg.data.max_response_length, self.cfg.reward.overlong_buffer
        scores_B, metrics = training_scores(
            self.rewards, self.tokenizer, records, trajectories, overlong, max_len, here
        )
        return scores_B.tolist(), metrics

    # ---------------------------------------------------------------------------------- weights

    async def _between_steps(self) -> None:
        """Before each engine step: a published version is loaded now with partial rollouts."""
        if self.a.partial_rollout and self.link.version() > self.version:
            self.engine.pause_generation()
            self.load_weights()
            self.engine.continue_generation()

    async def _sync_if_due(self) -> None:
        """Between loop turns: load a published version once nothing is in flight (without
        partial rollouts, requests finish on the weights they started with)."""
        if self.link.version() > self.version and (self.a.partial_rollout or not self.engine.has_work()):
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
        self.link.count(f"weights/ready/{'initial' if initial else self.version + 1}", 1)  # the trainer may send
        mb = self.cfg.rollout.update_weights_bucket_megabytes
        self.engine.load_weights(self.link.receive_weights(self.dtype, mb))
        if not initial:
            self.version += 1
            self.engine.weight_version = self.version
        checksum = getattr(self.engine, "checksum", None)
        key = "initial" if initial else str(self.version)
        self.link.put(f"weights/checksum/{key}/{self.r}", {"checksum": checksum(self.dtype) if checksum else None})

    # ---------------------------------------------------------------------------------- validation

    async def _serve_validation(self) -> None:
        """Rollout rank 0 answers the trainer's val/request (a version) once its engine is idle:
        greedy decoding (its own sampler) cannot share the engine with sampled requests."""
        if self.r != 0 or self.val is None or not self.link.store.check(["val/request"]):
            return
        if self.version < self.link.wait_take_shared("val/request"):
            return  # the weights it asks about are still to come: sync first
        while self.inflight or self.engine.has_work():
            await self._wait_a_little()
        version = self.link.take("val/request")
        records = self.val.records
        params = evaluate.greedy_params(self.cfg.data.max_response_length)
        samples = to_samples(records, list(range(len(records))), params, prefix="val-")
        trajectories = await self.agents.run_batch(self.server, samples, [r.agent_name for r in records])
        here = DistContext(device=self.dist.device)
        out = evaluate.val_metrics(trajectories, self.rewards, self.tokenizer, self.val, here)
        self.link.put(f"val/result/{version}", out)


def batch_limit(version: int, staleness: int, trigger: int) -> int:
    """The first batch index a rollout rank holding weight `version` may not start yet. The
    trainer trains batch b at version b // trigger, so a batch started below this limit is at
    most `staleness` versions behind when it is trained (tests/unit/test_async.py proves it)."""
    return (version + staleness + 1) * trigger
