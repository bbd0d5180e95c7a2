"""Rollouts on the trainer's own ranks: each rank generates its prompts' samples with the engine
next to its actor and scores them; after every update the engine loads the actor's weights.
"""

from __future__ import annotations

from minirl import build
from minirl.agent.loop import to_samples
from minirl.batch import RolloutBatch
from minirl.data.prompts import expand_groups
from minirl.observe.evaluate import validate
from minirl.observe.step_metrics import engine_metrics, tool_time_metrics
from minirl.protocols import SamplingParams, Trajectory
from minirl.reward.manager import build_reward_manager, place_scores
from minirl.reward.trajectory import training_scores
from minirl.rollout.dynamic_sampling import FilterGroups
from minirl.rollout.source import BatchSource, Parts, Rollout, WeightSync
from minirl.rollout.trajectories import model_tokens, rollout_seed, sampling_params, to_batch


def collocated(parts: Parts) -> tuple[BatchSource, WeightSync]:
    """The engine (built after the critic: its KV cache takes a share of the memory left free),
    the reward functions and the validation set; dynamic sampling (algorithm.filter_groups)
    wraps the source."""
    pm, cfg, dist = parts.pm, parts.cfg, parts.dist
    adapter = parts.adapter
    engine = build.engine(pm, cfg, adapter.actor, parts.tokenizer, dist, adapter.shared_weights())
    rewards = build_reward_manager(cfg.reward, cfg.custom_reward_function, pm["reward_functions"], cfg.plugins.modules)
    val = build.val_set(cfg.trainer, cfg.data, parts.tokenizer, dist, parts.agents.tool_schemas)
    parts.agents.check_rows(val.records if val else [])
    source = Collocated(engine, parts.agents, rewards, parts.tokenizer, parts.loader, val, cfg, dist)
    if cfg.algorithm.filter_groups.enable:
        source = FilterGroups(source, parts.loader, cfg, dist)
    return source, EngineSync(engine, parts.adapter)


class Collocated:
    """rollout.n samples of every prompt, each through its row's agent loop over the engine
    (single_turn by default: one turn, exactly the batch generate()'s tokens), then scored."""

    sampled_by_current_weights = True
    old_log_probs_note = "a separate pass"

    def __init__(self, engine, agents, rewards, tokenizer, loader, val, cfg, dist):
        self.engine, self.agents, self.rewards, self.tokenizer = engine, agents, rewards, tokenizer
        self.loader, self.val, self.cfg, self.dist = loader, val, cfg, dist
        self.tool_s = [0.0, 0.0]  # this step's tool seconds, and the engine's idle ones among them

    def next(self, step: int, timer) -> Rollout:
        batch, metrics = self.generate_and_score(self.loader.next_batch(), step, timer)
        return Rollout(batch, metrics, model_tokens(batch.trajectories), self.source_metrics())

    def source_metrics(self) -> dict[str, float]:
        """The engine's account of the step, and (multi-turn) how much tool time it decoded through."""
        out = engine_metrics(self.engine, self.dist)
        if self.cfg.rollout.multi_turn.enable:
            out.update(tool_time_metrics(*self.tool_s, self.dist))
        self.tool_s = [0.0, 0.0]
        return out

    def generate_and_score(self, records, number: int, timer) -> tuple[RolloutBatch, dict[str, float]]:
        """Prompt batch `number` (its seed and group uids) generated, then scored."""
        with timer.phase("gen"):
            batch = self.generate(records, number)
        with timer.phase("reward"):
            return batch, self.score(batch)

    def generate(self, records, number: int) -> RolloutBatch:
        dist = self.dist
        seed = rollout_seed(self.cfg.trainer.seed, number, dist.dp_rank)
        params = sampling_params(self.cfg.rollout, self.cfg.data.max_response_length, seed)
        expanded, uids = expand_groups(
            records, self.cfg.rollout.n, (number * dist.dp_size + dist.dp_rank) * len(records)
        )
        trajectories = self.run_agents(expanded, uids, params)
        tools = self.agents.last_tool_time
        self.tool_s = [self.tool_s[0] + tools.wall_s, self.tool_s[1] + tools.engine_idle_s]
        return to_batch(expanded, uids, trajectories, self.cfg.rollout, self.cfg.actor.tis_imp_ratio_cap, dist.device)

    def run_agents(self, records, uids: list[int], params: SamplingParams, prefix: str = "") -> list[Trajectory]:
        """One Trajectory per (expanded) record, through the engine's request level; the KV cache
        is resumed and released around it (rollout.free_cache_engine)."""
        free = self.cfg.rollout.free_cache_engine
        if free:
            self.engine.resume_memory()
        samples = to_samples(records, uids, params, prefix)
        trajectories = self.agents.run(self.engine, samples, [rec.agent_name for rec in records])
        if free:
            self.engine.release_memory()
        return self.dist.sp_broadcast(trajectories)

    def score(self, batch: RolloutBatch) -> dict[str, float]:
        """The batch's scores (minirl.reward.trajectory), placed on each response's last token."""
        overlong, max_len = self.cfg.reward.overlong_buffer, self.cfg.data.max_response_length
        batch.scores_B, metrics = training_scores(
            self.rewards, self.tokenizer, batch.records, batch.trajectories, overlong, max_len, self.dist
        )
        batch.token_scores_BT = place_scores(batch.scores_B, batch.mask_BT)
        return metrics

    def validate(self) -> dict[str, float]:
        def rollout(records, params):
            return self.run_agents(records, list(range(len(records))), params, prefix="val-")

        return validate(rollout, self.rewards, self.tokenizer, self.val, self.cfg.data.max_response_length, self.dist)

    def state_dict(self) -> dict:
        return {}  # the data position is the loader's

    def load_state_dict(self, state: dict) -> None:
        pass

    def close(self) -> None:
        self.rewards.close()  # the reward workers never outlive the run


class EngineSync:
    """The engine loads the actor's weights after every update, one full tensor at a time (LoRA:
    the targeted matrices, merged: the frozen rest is what the engine loaded when it was built)."""

    def __init__(self, engine, adapter):
        self.engine, self.adapter = engine, adapter

    def start(self, resumed: bool) -> None:
        if resumed:  # the engine was built from the weights before the restore
            self.after_update()

    def after_update(self) -> dict[str, float]:
        self.engine.load_weights(self.adapter.engine_weights(changed_only=True))
        return {}
