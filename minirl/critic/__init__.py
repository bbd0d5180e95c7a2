"""The critic of PPO with GAE (algorithm.adv_estimator = "gae"): a value model, its values pass
and its update.

- minirl.critic.model: the value model (the actor's backbone + a scalar head) and its packed
  forward, V at the positions that predict the response tokens;
- minirl.critic.value_loss: verl's clipped value loss and the explained variance;
- minirl.critic.update: the values pass (before the advantages) and the critic update (beside
  the actor's), micro-batched and globally normalised exactly as the actor's.

The trainer builds a critic only when the advantage estimator needs values (`needs_values`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class Critic:
    """The assembled value model, its optimizer and LR scheduler, and its config section with
    ppo_mini_batch_size resolved (unset: the actor's), built by minirl.build.critic."""

    cfg: Any
    model: Any
    optimizer: Any
    scheduler: Any


def needs_values(estimator) -> bool:
    """An advantage estimator that reads AdvantageInputs.values_BT says so with the attribute
    `needs_values = True` (the built-in gae does); the trainer then builds a critic."""
    return bool(getattr(estimator, "needs_values", False))


def resolved(critic_cfg, actor_cfg):
    """The critic section with ppo_mini_batch_size set (unset means the actor's, as in verl)."""
    if critic_cfg.ppo_mini_batch_size is not None:
        return critic_cfg
    return dataclasses.replace(critic_cfg, ppo_mini_batch_size=actor_cfg.ppo_mini_batch_size)


def critic_line(cfg, critic_cfg) -> str:
    """The start-up line that spells out the critic (beside the effective-batch line)."""
    c, warmup, train_batch_size = critic_cfg, cfg.trainer.critic_warmup, cfg.data.train_batch_size
    minis = train_batch_size // c.ppo_mini_batch_size
    backbone = c.model.path or cfg.model.path or f"preset {cfg.model.preset!r}"
    warm = f"; steps 1..{warmup} update only the critic (critic_warmup: the actor update is skipped)" if warmup else ""
    return (
        f"critic: {backbone} + a scalar value head; {minis} mini-batch(es) x {c.ppo_epochs} epoch(s), "
        f"lr {c.optim.lr}, cliprange_value {c.cliprange_value}, loss_agg_mode {c.loss_agg_mode}{warm}"
    )
