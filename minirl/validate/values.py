"""The rules of one key at a time: finite floats, ranges, choices, and names that must be
registered by a plugin. A RANGES row is (key, test, rule, fix); a CHOICES row is (key, allowed).
minirl.validate.critic applies the same checks to its own tables.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any, Callable

from minirl.agent.parser import PARSERS
from minirl.algo.dynamic_sampling import SEQUENCE_METRICS
from minirl.algo.loss_agg import LOSS_AGG_MODES
from minirl.config.load import Config
from minirl.config.schema import CORE_SECTIONS
from minirl.data.prompts import TRUNCATIONS
from minirl.validate.problem import Problem, value


def value_problems(cfg: Config, pm) -> list[Problem]:
    return [*_non_finite(cfg), *range_problems(cfg, RANGES), *choice_problems(cfg, CHOICES), *_registries(cfg, pm)]


def _non_finite(cfg: Config) -> list[Problem]:
    """NaN or inf in any float of a core section poisons every update it touches."""
    out = []
    for name in CORE_SECTIONS:
        for key, v in _floats(getattr(cfg, name), name):
            if not math.isfinite(v):
                out.append(Problem(key, v, "must be a finite number", "set a real value (see bench.toml)"))
    return out


def _floats(section: Any, prefix: str):
    for f in dataclasses.fields(section):
        v = getattr(section, f.name)
        if dataclasses.is_dataclass(v):
            yield from _floats(v, f"{prefix}.{f.name}")
        elif isinstance(v, float):
            yield f"{prefix}.{f.name}", v
        elif isinstance(v, list):
            yield from ((f"{prefix}.{f.name}", x) for x in v if isinstance(x, float))


def at_least(lo: float) -> Callable[[Any], bool]:
    return lambda v: v >= lo


def optional(test: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or test(v)


def between(lo: float, hi: float, open_lo: bool = False) -> Callable[[Any], bool]:
    return lambda v: (lo < v if open_lo else lo <= v) and v <= hi


# (key, test, rule, fix)
RANGES: list[tuple[str, Callable[[Any], bool], str, str]] = [
    *[
        (f"{s}.recompute_num_layers", at_least(-1), "must be >= 0 layers, or -1 for every layer", "use -1")
        for s in ("model", "critic.model")
    ],
    ("model.precompile_wait_s", at_least(0), "must be >= 0 seconds", "use 0 (never wait)"),
    ("data.train_batch_size", at_least(1), "must be at least 1 (prompts per step)", "use e.g. 16"),
    ("data.max_prompt_length", at_least(1), "must be at least 1 token", "use e.g. 512"),
    ("data.max_response_length", at_least(1), "must be at least 1 token", "use e.g. 512"),
    ("data.prompt_key", bool, "must name the prompt column", "use 'prompt'"),
    ("actor.ppo_mini_batch_size", at_least(1), "must be at least 1 (prompts per optimizer step)", "use e.g. 8"),
    ("actor.ppo_micro_batch_size_per_gpu", at_least(1), "must be at least 1 sequence", "use e.g. 4"),
    ("actor.ppo_max_token_len_per_gpu", at_least(1), "must be at least 1 token", "use e.g. 16384"),
    ("actor.ppo_epochs", at_least(1), "must be at least 1 (0 never updates the model)", "use 1"),
    ("actor.clip_ratio", at_least(0), "a clip range must be >= 0", "use 0.2"),
    ("actor.clip_ratio_low", optional(at_least(0)), "a clip range must be >= 0", "use 0.2, or leave it unset"),
    ("actor.clip_ratio_high", optional(at_least(0)), "a clip range must be >= 0", "use 0.28, or leave it unset"),
    ("actor.clip_ratio_c", lambda v: v > 1, "the dual-clip bound must be > 1", "use 3.0"),
    ("actor.loss_scale_factor", optional(lambda v: v > 0), "must be > 0", "leave it unset"),
    ("actor.kl_loss_coef", at_least(0), "a negative coefficient rewards drifting away", "use a value >= 0"),
    ("actor.grad_clip", lambda v: v > 0, "must be > 0", "use 1.0"),
    ("actor.tis_imp_ratio_cap", lambda v: v > 0 or v == -1, "a weight cap must be > 0 (on) or -1 (off)", "use -1"),
    ("actor.ulysses_sequence_parallel_size", at_least(1), "must be at least 1", "use 1 (no sequence parallelism)"),
    ("actor.optim.lr", at_least(0), "a learning rate must be >= 0", "use e.g. 1e-6"),
    ("actor.optim.weight_decay", at_least(0), "must be >= 0", "use 0.01"),
    (
        "actor.optim.betas",
        lambda v: len(v) == 2 and all(0 <= b < 1 for b in v),
        "needs two values in [0, 1)",
        "use [0.9, 0.999]",
    ),
    ("actor.optim.eps", lambda v: v > 0, "must be > 0", "use 1e-8"),
    ("actor.optim.lr_warmup_steps", at_least(-1), "must be >= 0, or -1 for lr_warmup_steps_ratio", "use -1"),
    ("actor.optim.lr_warmup_steps_ratio", between(0, 1), "must lie in [0, 1]", "use 0.0"),
    ("actor.optim.min_lr_ratio", between(0, 1), "must lie in [0, 1]", "use 0.0"),
    ("rollout.n", at_least(1), "must be at least 1 sample per prompt", "use e.g. 8"),
    ("rollout.temperature", at_least(0), "must be >= 0 (0 is greedy)", "use 1.0"),
    ("rollout.top_p", between(0, 1, open_lo=True), "must lie in (0, 1]", "use 1.0 (no nucleus filter)"),
    ("rollout.gpu_memory_utilization", between(0, 1, open_lo=True), "must lie in (0, 1]", "use 0.5"),
    ("rollout.max_num_seqs", at_least(1), "must be at least 1", "use 1024"),
    ("rollout.update_weights_bucket_megabytes", at_least(1), "must be at least 1 MiB", "use 512"),
    ("rollout.multi_turn.max_parallel_calls", at_least(1), "must be at least 1 call per turn", "use 1"),
    ("rollout.nnodes", at_least(1), "must be at least 1 node", "use 1"),
    ("rollout.n_gpus_per_node", at_least(0), "must be >= 0 (0: no rollout ranks of their own)", "use 0, or 1"),
    ("async_training.staleness_threshold", at_least(0), "must be >= 0 versions (0: on-policy)", "use 1"),
    ("async_training.trigger_parameter_sync_step", at_least(1), "must be at least 1 step", "use 1"),
    ("async_training.require_batches", at_least(1), "must be at least 1 mini-batch", "use 1"),
    ("rollout.multi_turn.max_tool_response_length", at_least(1), "must be at least 1 character", "use 256"),
    (
        "rollout.multi_turn.max_assistant_turns",
        lambda v: v is None or v >= 1,
        "must be at least 1 turn (unset: no limit)",
        "use e.g. 5, or leave it unset",
    ),
    (
        "rollout.multi_turn.max_tokens_per_turn",
        lambda v: v is None or v >= 1,
        "must be at least 1 token (unset: what is left of data.max_response_length)",
        "use e.g. 512, or leave it unset",
    ),
    (
        "rollout.multi_turn.max_user_turns",
        lambda v: v is None or v >= 0,
        "must be >= 0 tool/user messages (unset: no limit)",
        "use e.g. 4, or leave it unset",
    ),
    ("rollout.log_prob_micro_batch_size_per_gpu", at_least(1), "must be at least 1 sequence", "use e.g. 8"),
    ("rollout.log_prob_max_token_len_per_gpu", at_least(1), "must be at least 1 token", "use e.g. 16384"),
    ("ref.log_prob_micro_batch_size_per_gpu", at_least(1), "must be at least 1 sequence", "use e.g. 8"),
    ("ref.log_prob_max_token_len_per_gpu", at_least(1), "must be at least 1 token", "use e.g. 16384"),
    ("ref.ulysses_sequence_parallel_size", at_least(1), "must be at least 1", "use 1 or the actor's"),
    ("algorithm.gamma", between(0, 1), "a discount must lie in [0, 1]", "use 1.0"),
    ("algorithm.lam", between(0, 1), "must lie in [0, 1]", "use 1.0"),
    ("algorithm.kl_ctrl.kl_coef", at_least(0), "a negative β rewards drifting away", "use a value >= 0"),
    ("algorithm.kl_ctrl.target_kl", lambda v: v > 0, "the adaptive controller divides by it", "use e.g. 0.1"),
    ("algorithm.kl_ctrl.horizon", lambda v: v > 0, "must be a positive number of sequences", "use e.g. 10000"),
    ("trainer.total_training_steps", at_least(0), "must be >= 0 (0: from total_epochs and the data)", "use 0"),
    ("trainer.total_epochs", at_least(0), "must be >= 0", "use 1"),
    ("trainer.n_gpus_per_node", at_least(1), "must be at least 1", "use the number of GPUs to train on"),
    ("trainer.nnodes", at_least(1), "must be at least 1 node", "use 1, or the number of nodes of the Ray cluster"),
    ("trainer.world_size", at_least(1), "must be at least 1 process", "use 1 (or 2 for a CPU data-parallel test)"),
    ("trainer.collective_timeout_s", at_least(1), "must be at least 1 second", "use 300"),
    ("trainer.ray_placement_timeout_s", at_least(1), "must be at least 1 second", "use 120"),
    ("trainer.peak_flops", at_least(0), "must be >= 0 (0: from the device name)", "use 0"),
    ("trainer.max_nonfinite_steps", at_least(1), "must be at least 1 step", "use 3"),
    ("trainer.max_ckpt_to_keep", at_least(0), "must be >= 0 (0 keeps all)", "use 0"),
    ("reward.num_workers", at_least(0), "must be >= 0 (0 scores in the training process)", "use 0, or e.g. 4"),
    ("reward.timeout_s", lambda v: v > 0, "must be > 0 seconds", "use e.g. 60"),
    ("reward.overlong_buffer.penalty_factor", at_least(0), "a negative factor rewards overlong answers", "use 1.0"),
    ("trainer.experiment_name", bool, "must not be empty (it names the run directory)", "use e.g. 'run'"),
]

DTYPES = ("float32", "bfloat16", "float16")

CHOICES: list[tuple[str, tuple[str, ...]]] = [
    ("model.dtype", DTYPES),
    ("data.truncation", TRUNCATIONS),
    ("actor.loss_agg_mode", tuple(LOSS_AGG_MODES)),
    ("actor.optim.warmup_style", ("constant", "cosine")),
    *[(f"{section}.fsdp_config.param_dtype", ("auto", *DTYPES)) for section in ("actor", "ref")],
    *[(f"{section}.fsdp_config.reduce_dtype", DTYPES) for section in ("actor", "ref")],
    ("rollout.dtype", ("auto", *DTYPES)),
    ("rollout.kv_cache_dtype", ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")),
    ("rollout.quantization", ("none", "fp8")),
    ("algorithm.kl_ctrl.type", ("fixed", "adaptive")),
    ("trainer.device", ("auto", "cpu", "cuda")),
    ("trainer.resume_mode", ("auto", "disable", "resume_path")),
    ("reward.reward_manager", ("naive", "batch")),
    ("rollout.multi_turn.tool_response_truncate_side", ("left", "right", "middle")),
    ("rollout.multi_turn.format", tuple(PARSERS)),
    ("algorithm.filter_groups.metric", tuple(SEQUENCE_METRICS)),
]


def range_problems(cfg: Config, rows) -> list[Problem]:
    """The RANGES-shaped `rows` whose test the key's value fails."""
    return [Problem(key, value(cfg, key), rule, fix) for key, test, rule, fix in rows if not test(value(cfg, key))]


def choice_problems(cfg: Config, rows) -> list[Problem]:
    """The CHOICES-shaped `rows` whose key holds a value not allowed (None: unset, the default's)."""
    out = []
    for key, allowed in rows:
        v = value(cfg, key)
        if v is not None and v not in allowed:
            out.append(Problem(key, v, "unknown value", f"choose one of {', '.join(allowed)}{_close(v, allowed)}"))
    return out


def _close(v: Any, allowed) -> str:
    hint = difflib.get_close_matches(str(v), list(allowed), n=1)
    return f" (did you mean {hint[0]!r}?)" if hint else ""


def _registries(cfg: Config, pm) -> list[Problem]:
    """Names that select a plugin component must be registered."""
    a, alg = cfg.actor, cfg.algorithm
    wanted = [
        ("algorithm.adv_estimator", "advantage_estimators", alg.adv_estimator, True),
        ("actor.policy_loss", "policy_losses", a.policy_loss, True),
        ("actor.kl_loss_type", "kl_estimators", a.kl_loss_type, a.use_kl_loss),
        ("algorithm.kl_penalty", "kl_estimators", alg.kl_penalty, alg.use_kl_in_reward),
        ("rollout.name", "rollout_engines", cfg.rollout.name, True),
        ("rollout.agent.default_agent_loop", "agent_loops", cfg.rollout.agent.default_agent_loop, True),
    ]
    wanted += [(f"trainer.logger[{i}]", "loggers", name, True) for i, name in enumerate(cfg.trainer.logger)]
    out = []
    for key, kind, name, used in wanted:
        if used and name not in pm[kind]:
            rule, fix = pm[kind].unknown_rule_fix(name)
            out.append(Problem(key, name, rule, fix))
    return out + _kl_penalty_per_token(cfg, pm)


def _kl_penalty_per_token(cfg: Config, pm) -> list[Problem]:
    """KL in the reward is a per-token penalty from the sampled tokens' log-probs; an estimator
    over whole logits (`full`) has nothing to read there."""
    alg = cfg.algorithm
    if not alg.use_kl_in_reward or not getattr(pm["kl_estimators"].items.get(alg.kl_penalty), "needs_logits", False):
        return []
    rule = "KL in the reward reads the sampled tokens' log-probs; this estimator needs whole logits"
    fix = "choose kl, abs, mse or low_var_kl (full is for actor.kl_loss_type)"
    return [Problem("algorithm.kl_penalty", alg.kl_penalty, rule, fix)]
