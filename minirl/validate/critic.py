"""The rules of the [critic] section's own keys and trainer.critic_warmup.

They apply only when algorithm.adv_estimator needs values (gae); otherwise no critic is built.
A key left unset takes the actor's value, which the actor's rules already check, so these check
only the keys that are set. The critic's batch, layout and token-budget rules sit beside the
actor's in minirl.validate.layout, its model directory in minirl.validate.files.
"""

from __future__ import annotations

from minirl.config.load import Config
from minirl.critic import CRITIC_ONLY_KEYS, needs_values
from minirl.validate.problem import Problem
from minirl.validate.values import CHOICES, RANGES, at_least, choice_problems, optional, range_problems

CRITIC_RANGES = [
    ("critic.ppo_mini_batch_size", optional(at_least(1)), "must be at least 1 (prompts per step)", "leave it unset"),
    ("critic.ppo_micro_batch_size_per_gpu", optional(at_least(1)), "must be at least 1 sequence", "use e.g. 4"),
    ("critic.ppo_max_token_len_per_gpu", optional(at_least(1)), "must be at least 1 token", "use e.g. 16384"),
    ("critic.forward_micro_batch_size_per_gpu", optional(at_least(1)), "must be at least 1 sequence", "leave it unset"),
    ("critic.forward_max_token_len_per_gpu", optional(at_least(1)), "must be at least 1 token", "leave it unset"),
    ("critic.ppo_epochs", optional(at_least(1)), "must be at least 1 (0 never updates the critic)", "use 1"),
    ("critic.cliprange_value", lambda v: v > 0, "must be > 0", "use 0.5 (a large value turns the clip off)"),
    ("critic.grad_clip", lambda v: v > 0, "must be > 0", "use 1.0"),
    ("critic.ulysses_sequence_parallel_size", at_least(1), "must be at least 1", "use 1 or the actor's"),
    ("trainer.critic_warmup", at_least(0), "must be >= 0 steps", "use 0 (the actor trains from step 1)"),
    # the optimizer keys follow the actor's rules
    *[(k.replace("actor.optim.", "critic.optim."), *rest) for k, *rest in RANGES if k.startswith("actor.optim.")],
]

# loss_agg_mode, optim.warmup_style and the fsdp dtypes follow the actor's choices
CRITIC_CHOICES = [(k.replace("actor.", "critic.", 1), allowed) for k, allowed in CHOICES if k.startswith("actor.")]


def critic_problems(cfg: Config, pm) -> list[Problem]:
    if not uses_critic(cfg, pm):
        return []
    return [*range_problems(cfg, CRITIC_RANGES), *choice_problems(cfg, CRITIC_CHOICES)]


def uses_critic(cfg: Config, pm) -> bool:
    name = cfg.algorithm.adv_estimator
    estimators = pm["advantage_estimators"]
    return name in estimators and needs_values(estimators.get(name))


def unused_keys(cfg: Config, pm) -> tuple[str, ...]:
    """The keys (dotted prefixes) a run without a critic ignores; --print-config leaves their
    defaults out, so running the printed file draws no "ignored" notice."""
    return () if uses_critic(cfg, pm) else CRITIC_ONLY_KEYS
