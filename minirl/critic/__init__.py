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

from dataclasses import dataclass
from typing import Any


@dataclass
class Critic:
    """The assembled value model, its optimizer and its LR scheduler (minirl.build.critic)."""

    model: Any
    optimizer: Any
    scheduler: Any


def needs_values(estimator) -> bool:
    """An advantage estimator that reads AdvantageInputs.values_BT says so with the attribute
    `needs_values = True` (the built-in gae does); the trainer then builds a critic."""
    return bool(getattr(estimator, "needs_values", False))


def critic_line(cfg, train_batch_size: int) -> str:
    """The start-up line that spells out the critic (beside the effective-batch line)."""
    c, warmup = cfg.critic, cfg.trainer.critic_warmup
    minis = train_batch_size // c.ppo_mini_batch_size
    backbone = c.model.path or cfg.model.path or f"preset {cfg.model.preset!r}"
    warm = f"; steps 1..{warmup} update only the critic (critic_warmup: the actor update is skipped)" if warmup else ""
    return (
        f"critic: {backbone} + a scalar value head; {minis} mini-batch(es) x {c.ppo_epochs} epoch(s), "
        f"lr {c.optim.lr}, cliprange_value {c.cliprange_value}, loss_agg_mode {c.loss_agg_mode}{warm}"
    )
