"""Building a run's components from the config: the models, the data, the rollout engine, the
losses, the updates and the micro-batching of every pass, and the loggers. The trainer calls
these once, in order, before its loop (minirl/trainer.py); each takes only the sections it needs.
"""

from __future__ import annotations

import os

import torch

from minirl import adapter
from minirl.agent.loop import AgentRollout
from minirl.batch import MicroBatching
from minirl.config.load import Config, to_toml
from minirl.critic import Critic, critic_only, needs_values, resolved
from minirl.critic.model import build_value_model
from minirl.data.prompts import PromptLoader, load_prompts
from minirl.dist.context import DistContext
from minirl.models import assembly
from minirl.models.loading import load_model_for_rank
from minirl.observe.evaluate import ValSet, load_val_set
from minirl.protocols import EngineContext
from minirl.update import actor as actor_lib
from minirl.update.loop import Update


def models(pm, cfg: Config, dist: DistContext):
    """(tokenizer, model adapter): the policy loaded once and assembled into the actor by its
    adapter (minirl.adapter: full fine-tuning or LoRA), with a reference when a KL needs one."""
    model, tokenizer = load_model_for_rank(cfg.model, dist, getattr(torch, cfg.model.dtype))  # ranks > 0: meta
    return tokenizer, adapter.assemble(pm, model, cfg, dist, needs_reference(cfg))


def needs_reference(cfg: Config) -> bool:
    """A KL term (the loss's or the reward's) reads the reference policy's log-probs."""
    return cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward


def critic(pm, cfg: Config, dist: DistContext, total_steps: int, estimator, say) -> Critic | None:
    """The value model with its optimizer and LR schedule when the advantage estimator needs
    values (gae); else None, and a configured [critic] key or trainer.critic_warmup is unused,
    which `say` reports."""
    if not needs_values(estimator):
        unused = sorted(k for k in cfg.origins if critic_only(k))
        if unused:
            say(
                f"minirl: notice: {', '.join(unused)} ignored: algorithm.adv_estimator = "
                f"{cfg.algorithm.adv_estimator!r} needs no critic (only an estimator of values, e.g. gae, trains one)"
            )
        return None
    model = build_value_model(pm, cfg, dist)
    optimizer, scheduler = assembly.build_optimizer(pm, model, cfg.critic.optim, total_steps)
    return critic_from_model(cfg, model, optimizer, scheduler, dist)


def critic_from_model(cfg: Config, model, optimizer, scheduler, dist: DistContext) -> Critic:
    """The assembled critic's update and values pass, from the critic section with its unset
    keys resolved (the values pass's forward_* keys, else its update's, else the actor's)."""
    c = resolved(cfg.critic, cfg.actor)
    values_micro = MicroBatching(c.forward_micro_batch_size_per_gpu, c.use_dynamic_bsz, c.forward_max_token_len_per_gpu)
    return Critic(c, update_loop(cfg, c, model, optimizer, dist, "critic/"), scheduler, values_micro)


def actor_update(cfg: Config, actor, optimizer, losses: actor_lib.Losses, dist: DistContext, on_policy: bool):
    """The actor's update; `on_policy`: the trainer skips the old-log-prob pass (Trainer.on_policy)."""
    job = update_loop(cfg, cfg.actor, actor, optimizer, dist, "actor/", cfg.actor.loss_scale_factor)
    return actor_lib.ActorUpdate(job, cfg.actor, losses, actor_lib.logprob_temperature(cfg.rollout), on_policy)


def update_loop(cfg: Config, section, model, optimizer, dist: DistContext, prefix: str, loss_scale_factor=None):
    """An update loop (minirl.update.loop.Update) from the ppo_* keys of `section` (actor, or the
    resolved critic); `prefix` names its metrics."""
    return Update(
        model,
        optimizer,
        prefix,
        epochs=section.ppo_epochs,
        shuffle=section.shuffle,
        seqs_per_mini=section.ppo_mini_batch_size * cfg.rollout.n // dist.dp_size,
        micro=MicroBatching(
            section.ppo_micro_batch_size_per_gpu, section.use_dynamic_bsz, section.ppo_max_token_len_per_gpu
        ),
        grad_clip=section.grad_clip,
        max_response_length=cfg.data.max_response_length,
        loss_scale_factor=loss_scale_factor,
    )


def log_prob_micro(section) -> MicroBatching:
    """A log-prob pass's micro-batches (rollout.* for the old, ref.* for the reference's):
    log_prob_micro_batch_size_per_gpu, log_prob_use_dynamic_bsz, log_prob_max_token_len_per_gpu."""
    s, size = section, section.log_prob_micro_batch_size_per_gpu
    return MicroBatching(size, s.log_prob_use_dynamic_bsz, s.log_prob_max_token_len_per_gpu)


def agent_rollout(pm, cfg: Config, tokenizer) -> AgentRollout:
    """The agent loops and tools (rollout.agent, rollout.multi_turn) every rollout runs through."""
    return AgentRollout(cfg.rollout, pm["agent_loops"], pm["tools"], tokenizer, template_source(cfg.model))


def template_source(model_cfg) -> str:
    """The config key the tokenizer, and so its chat template, comes from (load_tokenizer's order)."""
    if model_cfg.tokenizer:
        return f"model.tokenizer = {model_cfg.tokenizer!r}"
    if model_cfg.path:
        return f"model.path = {model_cfg.path!r}"
    return f"model.preset = {model_cfg.preset!r}"


def train_loader(data_cfg, tokenizer, dist: DistContext, tools_for=None) -> PromptLoader:
    """This rank's shard of the training prompts (whole groups per rank); tools_for(agent_name):
    the tool schemas a row's prompt shows (AgentRollout.tool_schemas)."""
    records = load_prompts(data_cfg.train_files, tokenizer, data_cfg, tools_for)
    loader = PromptLoader(records, data_cfg.train_batch_size, data_cfg.shuffle, data_cfg.seed)
    return loader.shard(dist.dp_rank, dist.dp_size)


def val_set(trainer_cfg, data_cfg, tokenizer, dist: DistContext, tools_for=None) -> ValSet | None:
    """The validation prompts (data.val_files, validated up front), or None when the run never validates."""
    if not (trainer_cfg.val_before_train or trainer_cfg.test_freq > 0):
        return None
    return load_val_set(data_cfg, tokenizer, dist, tools_for)


def total_steps(trainer_cfg, steps_per_epoch: int) -> int:
    return trainer_cfg.total_training_steps or trainer_cfg.total_epochs * steps_per_epoch


def engine(pm, cfg: Config, actor, tokenizer, dist: DistContext, shared: dict | None = None):
    """The rollout engine named by rollout.name, next to the actor (KV cache released when
    rollout.free_cache_engine); shared: the actor's tensors it may hold instead of copies
    (EngineContext.shared; the model adapter's shared_weights)."""
    r = cfg.rollout
    ctx = EngineContext(
        model_config=actor.config,
        actor=actor,
        device=dist.device,
        dtype=cfg.engine_dtype(dist.device),
        eos_token_ids=eos_ids(tokenizer, actor.config),
        pad_token_id=pad_id(tokenizer),
        extra={
            "progress": cfg.trainer.progress_bar and dist.is_main,
            "max_model_len": cfg.data.max_prompt_length + cfg.data.max_response_length,
            "max_batch_rows": cfg.data.train_batch_size // dist.dp_size * r.n,  # a step's generate call
            "seed": cfg.trainer.seed + dist.dp_rank,  # engines with a seed of their own (sglang)
        },
        shared=shared or {},
    )
    built = pm["rollout_engines"].get(r.name)(r, ctx)
    if r.free_cache_engine:
        built.release_memory()
    return built


def losses(pm, actor_cfg, reference) -> actor_lib.Losses:
    kl = pm["kl_estimators"].get(actor_cfg.kl_loss_type) if actor_cfg.use_kl_loss else None
    return actor_lib.Losses(pm["policy_losses"].get(actor_cfg.policy_loss), kl, reference)


def loggers(pm, cfg: Config, run_dir: str, start_step: int, dist: DistContext) -> list:
    """The trainer.logger backends (rank 0 only), after writing the run's config.toml; a resumed
    run's loggers drop what a crashed run logged past the checkpoint."""
    if not dist.is_main:
        return []
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.toml"), "w") as f:
        f.write(to_toml(cfg))
    built = [pm["loggers"].get(name)(cfg.trainer, run_dir) for name in cfg.trainer.logger]
    for logger in built:
        if start_step > 0 and hasattr(logger, "resume"):
            logger.resume(start_step)
    return built


def eos_ids(tokenizer, model_config) -> tuple[int, ...]:
    ids = {tokenizer.eos_token_id}
    eos = getattr(model_config, "eos_token_id", None)
    ids |= set(eos) if isinstance(eos, (list, tuple)) else {eos}
    return tuple(sorted(i for i in ids if i is not None))


def pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
