"""The rules of the [critic] section and trainer.critic_warmup (part of minirl.validate.core).

They apply only when algorithm.adv_estimator needs values (gae): otherwise no critic is built and
its keys are ignored, with a notice at start-up (minirl.build.critic). A key left unset takes the
actor's value (minirl.critic.resolved), which the actor's rules already check, so the rules of
one key check only the keys that are set; the rules that join keys check the resolved values
when one of their critic keys is set.
"""

from __future__ import annotations

from pathlib import Path

from minirl.config.load import Config
from minirl.critic import needs_values, resolved
from minirl.validate.core import Problem, value
from minirl.validate.values import DTYPES, RANGES, at_least, optional

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

CRITIC_CHOICES = [
    ("critic.loss_agg_mode", "actor.loss_agg_mode"),
    ("critic.optim.warmup_style", "actor.optim.warmup_style"),
    ("critic.fsdp_config.param_dtype", ("auto", *DTYPES)),
    ("critic.fsdp_config.reduce_dtype", DTYPES),
]


def critic_problems(cfg: Config, pm) -> list[Problem]:
    if not uses_critic(cfg, pm):
        return []
    out = [Problem(k, value(cfg, k), rule, fix) for k, test, rule, fix in CRITIC_RANGES if not test(value(cfg, k))]
    out += _choices(cfg)
    if out:
        return out  # the joins below need sane values
    return _batches(cfg) + _token_budget(cfg) + _layout(cfg) + _model_path(cfg)


def uses_critic(cfg: Config, pm) -> bool:
    name = cfg.algorithm.adv_estimator
    estimators = pm["advantage_estimators"]
    return name in estimators and needs_values(estimators.get(name))


def _choices(cfg: Config) -> list[Problem]:
    from minirl.validate.values import CHOICES

    actor_choices = dict(CHOICES)
    out = []
    for key, allowed in CRITIC_CHOICES:
        allowed = actor_choices[allowed] if isinstance(allowed, str) else allowed
        v = value(cfg, key)
        if v is not None and v not in allowed:
            out.append(Problem(key, v, "unknown value", f"choose one of {', '.join(allowed)}"))
    return out


def _batches(cfg: Config) -> list[Problem]:
    """A critic mini-batch is whole prompts of the step, on every data-parallel rank."""
    from minirl.validate.core import world_size

    batch, mini, key = cfg.data.train_batch_size, cfg.critic.ppo_mini_batch_size, "critic.ppo_mini_batch_size"
    if mini is None or batch < 1:  # unset: the actor's mini-batch, checked by minirl.validate.core
        return []
    if mini > batch or batch % mini:
        return [
            Problem(key, mini, f"must divide data.train_batch_size = {batch}", "use a divisor of it, e.g. the actor's")
        ]
    sp = max(1, cfg.actor.ulysses_sequence_parallel_size)
    dp = max(1, world_size(cfg) // sp)
    if mini % dp:
        return [Problem(key, mini, f"does not divide over {dp} data-parallel ranks", f"use a multiple of {dp}")]
    return []


def _token_budget(cfg: Config) -> list[Problem]:
    """With dynamic batching a micro-batch holds at least one whole sequence: the update's budget
    (unless both keys are the actor's, which minirl.validate.core checks) and the values pass's own."""
    c, own = resolved(cfg.critic, cfg.actor), cfg.critic
    if not c.use_dynamic_bsz:
        return []
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    rule = f"smaller than one sequence (max_prompt_length + max_response_length = {longest})"
    checked = {
        "ppo_max_token_len_per_gpu": own.use_dynamic_bsz is not None or own.ppo_max_token_len_per_gpu is not None,
        "forward_max_token_len_per_gpu": own.forward_max_token_len_per_gpu is not None,
    }
    return [
        Problem(f"critic.{key}", getattr(c, key), rule, f"use >= {longest}")
        for key, check in checked.items()
        if check and getattr(c, key) < longest
    ]


def _layout(cfg: Config) -> list[Problem]:
    sp, critic_sp = cfg.actor.ulysses_sequence_parallel_size, cfg.critic.ulysses_sequence_parallel_size
    if critic_sp in (1, sp) or critic_sp < 1:
        return []
    rule = "the critic runs on the actor's mesh"
    return [Problem("critic.ulysses_sequence_parallel_size", critic_sp, rule, f"use 1 or the actor's {sp}")]


def _model_path(cfg: Config) -> list[Problem]:
    path = cfg.critic.model.path
    if not path:
        return []
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        rule = "is not a Hugging Face model directory (no config.json)"
        return [Problem("critic.model.path", path, rule, "point it at one, or leave it empty for the actor's model")]
    return []
