"""The critic of PPO with GAE (algorithm.adv_estimator = "gae"): a value model, its values pass
and its update.

- minirl.critic.model: the value model (the actor's backbone + a scalar head) and its packed
  forward, V at the positions that predict the response tokens;
- minirl.critic.value_loss: verl's clipped value loss and the explained variance;
- minirl.critic.update: the values pass (before the advantages) and the critic's micro-batch
  loss in the actor's update loop (minirl.update.loop).

The trainer builds a critic only when the advantage estimator needs values (`needs_values`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from minirl.batch import MicroBatching
from minirl.update.loop import Update


@dataclass
class Critic:
    """The assembled value model with its update (optimizer, how the loop walks a batch), its LR
    scheduler, the values pass's micro-batching, and its config section with every unset key
    resolved (`resolved`), built by minirl.build.critic."""

    cfg: Any
    update: Update
    scheduler: Any
    values_micro: MicroBatching

    @property
    def model(self) -> torch.nn.Module:
        return self.update.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.update.optimizer


def needs_values(estimator) -> bool:
    """An advantage estimator that reads AdvantageInputs.values_BT says so with the attribute
    `needs_values = True` (the built-in gae does); the trainer then builds a critic."""
    return bool(getattr(estimator, "needs_values", False))


# critic keys that default to the actor's value when unset (verl's config interpolates them)
# what a run without a critic ignores: the [critic] section and trainer.critic_warmup
CRITIC_ONLY_KEYS = ("critic", "trainer.critic_warmup")


def critic_only(key: str) -> bool:
    """Whether the dotted config key belongs to CRITIC_ONLY_KEYS."""
    return any(key == p or key.startswith(f"{p}.") for p in CRITIC_ONLY_KEYS)


FROM_ACTOR = ("ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz", "ppo_max_token_len_per_gpu")
FROM_ACTOR += ("ppo_epochs", "shuffle", "loss_agg_mode")


# values-pass keys that default to the critic's own update keys when unset (verl's interpolation)
FROM_UPDATE = {
    "forward_micro_batch_size_per_gpu": "ppo_micro_batch_size_per_gpu",
    "forward_max_token_len_per_gpu": "ppo_max_token_len_per_gpu",
}


def resolved(critic_cfg, actor_cfg):
    """The critic section with every unset FROM_ACTOR key set to the actor's value, then every
    unset FROM_UPDATE key to the critic's own update key."""
    unset = {k: getattr(actor_cfg, k) for k in FROM_ACTOR if getattr(critic_cfg, k) is None}
    cfg = dataclasses.replace(critic_cfg, **unset)
    unset = {k: getattr(cfg, src) for k, src in FROM_UPDATE.items() if getattr(cfg, k) is None}
    return dataclasses.replace(cfg, **unset)


def critic_line(cfg, critic: Critic) -> str:
    """The start-up line that spells out the critic (beside the effective-batch line)."""
    c, warmup, train_batch_size = critic.cfg, cfg.trainer.critic_warmup, cfg.data.train_batch_size
    minis = train_batch_size // c.ppo_mini_batch_size
    backbone = c.model.path or cfg.model.path or f"preset {cfg.model.preset!r}"
    warm = f"; steps 1..{warmup} update only the critic (critic_warmup: the actor update is skipped)" if warmup else ""
    return (
        f"critic: {backbone} + a scalar value head; {minis} mini-batch(es) x {c.ppo_epochs} epoch(s); "
        f"micro-batches: {critic.update.micro.describe()}; lr {c.optim.lr}, cliprange_value "
        f"{c.cliprange_value}, loss_agg_mode {c.loss_agg_mode}{warm}"
    )
