"""One pass over the resolved config before any model loads or worker starts.

`validate(cfg, pm)` collects every invalid value at once and raises one ConfigError with a line
per problem: the key, its value, where the value came from (file, profile, command line or
default), the rule it breaks and the fix. Besides each key's own range it checks the rules
that join keys (mini-batch <= batch and dividing it, sp dividing the world, batches dividing
over data-parallel ranks, more than zero steps, TIS with rollout log-probs, GSPO's clip range).
minirl.validate.values holds the rules of one key at a time; minirl.validate.files checks the
files the config names: the model directory, the data (row counts, a reward function for every
data_source) and the output directory. `python -m minirl` and `--print-config` both run it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from minirl.config.load import Config, ConfigError


@dataclass(frozen=True)
class Problem:
    """One invalid value: `key = value (origin): rule; fix`."""

    key: str
    value: Any
    rule: str
    fix: str


def validate(cfg: Config, pm, files: bool = True) -> None:
    """Raise one ConfigError that lists every problem, or return quietly. files=False skips the
    checks of data, model and output paths (--print-config: a config may be printed on a machine
    that does not hold the job's files)."""
    problems = find_problems(cfg, pm, files)
    if problems:
        raise ConfigError(report(problems, cfg))


def find_problems(cfg: Config, pm, files: bool = True) -> list[Problem]:
    """Every problem, at most one per key (the first rule a key breaks)."""
    from minirl.validate.critic import critic_problems
    from minirl.validate.files import file_problems
    from minirl.validate.values import value_problems

    found: dict[str, Problem] = {}
    for check in (
        value_problems,
        _batches,
        _launcher,
        _device,
        _layout,
        _steps,
        _resume,
        _reward,
        _policy_loss,
        _filter_groups,
        _kv_cache,
        critic_problems,
    ):
        for p in check(cfg, pm):
            found.setdefault(p.key, p)
    if files and not any(k.startswith(("data.", "trainer.total")) for k in found):  # need sane sizes
        for p in file_problems(cfg, pm):
            found.setdefault(f"{p.key}:{p.value}", p)
    return list(found.values())


def report(problems: list[Problem], cfg: Config) -> str:
    lines = [f"{p.key} = {p.value!r} ({_origin(cfg, p.key)}): {p.rule}; {p.fix}" for p in problems]
    if len(lines) == 1:
        return lines[0]
    return f"{len(lines)} invalid config values:\n  " + "\n  ".join(lines)


def _origin(cfg: Config, key: str) -> str:
    return cfg.origin(key.split("[")[0])  # trainer.logger[0] was set as trainer.logger


def value(cfg: Config, key: str) -> Any:
    """cfg's value of a dotted key: value(cfg, "actor.optim.lr")."""
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


# ---------------------------------------------------------------------------------------------
# rules that join keys
# ---------------------------------------------------------------------------------------------


def _batches(cfg: Config, pm) -> list[Problem]:
    batch, mini = cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size
    if batch < 1 or mini < 1:
        return []  # the range rules already say so
    key = "actor.ppo_mini_batch_size"
    if mini > batch:
        return [Problem(key, mini, f"larger than data.train_batch_size = {batch}", f"use at most {batch}")]
    if batch % mini:
        divisors = [d for d in range(1, batch + 1) if batch % d == 0]
        return [
            Problem(
                key,
                mini,
                f"does not divide data.train_batch_size = {batch} (the rest would be left out)",
                f"use a divisor such as {max(d for d in divisors if d <= mini)}",
            )
        ]
    return _token_budgets(cfg)


def _token_budgets(cfg: Config) -> list[Problem]:
    """With dynamic batching a micro-batch must hold at least one whole sequence."""
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    out = []
    for section, dyn, budget in (
        ("actor", "use_dynamic_bsz", "ppo_max_token_len_per_gpu"),
        ("rollout", "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu"),
        ("ref", "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu"),
    ):
        s = getattr(cfg, section)
        if getattr(s, dyn) and getattr(s, budget) < longest:
            out.append(
                Problem(
                    f"{section}.{budget}",
                    getattr(s, budget),
                    f"smaller than one sequence (max_prompt_length + max_response_length = {longest})",
                    f"raise it to at least {longest}",
                )
            )
    return out


def _launcher(cfg: Config, pm) -> list[Problem]:
    """The launcher exists and fits the job: one node for local, torchrun's variables for torchrun."""
    from minirl.dist.launchers import AUTO, choose
    from minirl.dist.spmd import under_torchrun

    t, key = cfg.trainer, "trainer.launcher"
    if t.launcher != AUTO and t.launcher not in pm["launchers"]:
        names = ", ".join([AUTO, *sorted(pm["launchers"].items)])
        return [Problem(key, t.launcher, "no such launcher", f"choose one of {names}")]
    name, _ = choose(t)
    if name == "local" and t.nnodes > 1:
        rule = "the local launcher starts the processes of one machine"
        return [Problem("trainer.nnodes", t.nnodes, rule, "use trainer.launcher = 'ray' (or 'auto') for several nodes")]
    if name != "ray" and t.ray_address:
        return [Problem("trainer.ray_address", t.ray_address, f"unused: {key} = {name!r}", "use 'ray' or 'auto'")]
    if name == "local" and under_torchrun():
        return [Problem(key, t.launcher, "RANK and WORLD_SIZE are set (torchrun)", "use 'auto' or 'torchrun'")]
    if name == "torchrun" and not under_torchrun():
        return [Problem(key, t.launcher, "RANK and WORLD_SIZE are not set", "start with torchrun, or use 'auto'")]
    if t.device != "cuda" and t.nnodes > 1 and t.world_size % t.nnodes:
        rule = f"CPU processes in all, which must split evenly over trainer.nnodes = {t.nnodes}"
        return [Problem("trainer.world_size", t.world_size, rule, f"use a multiple of {t.nnodes}")]
    return []


def _device(cfg: Config, pm) -> list[Problem]:
    t = cfg.trainer
    if t.device not in ("cuda", "auto"):
        return []
    from minirl.dist.launchers import choose

    if choose(t)[0] == "ray":
        return []  # the GPUs are the Ray cluster's, not this machine's (the launcher checks them)
    import torch

    if t.device == "cuda" and not torch.cuda.is_available():
        return [Problem("trainer.device", t.device, "CUDA is not available here", "use 'cpu' or 'auto'")]
    count = torch.cuda.device_count()
    if torch.cuda.is_available() and t.n_gpus_per_node > count:
        return [
            Problem(
                "trainer.n_gpus_per_node", t.n_gpus_per_node, f"this machine has {count} GPU(s)", f"use at most {count}"
            )
        ]
    return []


def world_size(cfg: Config) -> int:
    """Worker processes of the job: torchrun's WORLD_SIZE, else GPUs of all nodes, else CPU processes."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    device = cfg.trainer.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes if device == "cuda" else cfg.trainer.world_size


def _layout(cfg: Config, pm) -> list[Problem]:
    """sp divides the world; batches divide over data-parallel ranks; the reference follows sp."""
    world, sp = world_size(cfg), cfg.actor.ulysses_sequence_parallel_size
    if world < 1 or sp < 1:
        return []
    if world % sp:
        return [
            Problem(
                "actor.ulysses_sequence_parallel_size",
                sp,
                f"does not divide the world size {world}",
                f"use a divisor of {world} (1 runs without sequence parallelism)",
            )
        ]
    dp, out = world // sp, []
    for key in ("data.train_batch_size", "actor.ppo_mini_batch_size"):
        v = value(cfg, key)
        if v >= 1 and v % dp:
            out.append(
                Problem(
                    key,
                    v,
                    f"does not divide over {dp} data-parallel ranks (world {world} / sp {sp})",
                    f"use a multiple of {dp}: ranks take whole prompts",
                )
            )
    ref_sp = cfg.ref.ulysses_sequence_parallel_size
    if ref_sp not in (1, sp):
        out.append(
            Problem(
                "ref.ulysses_sequence_parallel_size",
                ref_sp,
                "the reference runs on the actor's mesh",
                f"use 1 or the actor's {sp}",
            )
        )
    return out


def _steps(cfg: Config, pm) -> list[Problem]:
    t, out = cfg.trainer, []
    if t.total_training_steps == 0 and t.total_epochs == 0:
        out.append(
            Problem(
                "trainer.total_epochs",
                0,
                "zero epochs and trainer.total_training_steps = 0 train nothing",
                "set trainer.total_epochs >= 1 or trainer.total_training_steps > 0",
            )
        )
    if (t.test_freq > 0 or t.val_before_train) and not cfg.data.val_files:
        key = "trainer.test_freq" if t.test_freq > 0 else "trainer.val_before_train"
        out.append(
            Problem(
                key,
                value(cfg, key),
                "validation needs data.val_files",
                "list parquet files in data.val_files, or set test_freq = -1 and val_before_train = false",
            )
        )
    if not cfg.data.train_files:
        out.append(
            Problem(
                "data.train_files", [], "no training data", "list parquet files (make data writes data/*/train.parquet)"
            )
        )
    return out


def _resume(cfg: Config, pm) -> list[Problem]:
    t = cfg.trainer
    if getattr(t, "resume_mode", None) == "resume_path" and not t.resume_from_path:
        return [
            Problem(
                "trainer.resume_from_path",
                t.resume_from_path,
                "trainer.resume_mode = 'resume_path' needs it",
                "set it to a checkpoint directory, or use resume_mode = 'auto'",
            )
        ]
    return []


def _reward(cfg: Config, pm) -> list[Problem]:
    """The overlong buffer fits inside the response; a batch manager has a function to call."""
    r, out = cfg.reward, []
    buf, max_len = r.overlong_buffer, cfg.data.max_response_length
    if buf.enable and not 0 < buf.len < max_len:
        rule = f"must lie in (0, data.max_response_length = {max_len}) with reward.overlong_buffer.enable"
        out.append(Problem("reward.overlong_buffer.len", buf.len, rule, f"use e.g. {max(1, max_len // 4)}"))
    if r.reward_manager == "batch" and not cfg.custom_reward_function.path:
        rule = "a batch manager calls custom_reward_function with lists, and custom_reward_function.path is empty"
        fix = "set custom_reward_function.path, or use 'naive'"
        out.append(Problem("reward.reward_manager", r.reward_manager, rule, fix))
    return out


def _policy_loss(cfg: Config, pm) -> list[Problem]:
    """TIS needs the engine's log-probs; GSPO's lower clip bound 1 − clip_ratio_low must be > 0."""
    a, out = cfg.actor, []
    if a.tis_imp_ratio_cap > 0 and not cfg.rollout.calculate_log_probs:
        out.append(
            Problem(
                "actor.tis_imp_ratio_cap",
                a.tis_imp_ratio_cap,
                "truncated importance sampling needs the rollout log-probs, and rollout.calculate_log_probs = false",
                "set rollout.calculate_log_probs = true, or actor.tis_imp_ratio_cap = -1",
            )
        )
    if a.policy_loss == "gspo" and a.clip_ratio_low is not None and a.clip_ratio_low >= 1:
        out.append(
            Problem(
                "actor.clip_ratio_low",
                a.clip_ratio_low,
                "gspo clips the sequence ratio at 1 - clip_ratio_low, which must stay > 0",
                "leave it unset (GSPO's 3e-4), or use a value in [0, 1)",
            )
        )
    return out


def _filter_groups(cfg: Config, pm) -> list[Problem]:
    """Dynamic sampling compares the n samples of a group, before the KL penalty is applied."""
    fg = cfg.algorithm.filter_groups
    if not fg.enable:
        return []
    if cfg.rollout.n < 2:
        rule = "algorithm.filter_groups.enable = true compares the samples of a prompt; one has no spread"
        return [Problem("rollout.n", cfg.rollout.n, rule, "use rollout.n >= 2, or turn filter_groups off")]
    if fg.metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
        return [
            Problem(
                "algorithm.filter_groups.metric",
                fg.metric,
                "the KL penalty (algorithm.use_kl_in_reward) needs log-probs computed after the filter",
                "use 'seq_reward' or 'score'",
            )
        ]
    return []


def _kv_cache(cfg: Config, pm) -> list[Problem]:
    """The hf engine has no 8-bit KV cache (transformers' cache keeps the model dtype); the native
    and sglang engines have one, and an engine from another plugin reads the key itself."""
    r = cfg.rollout
    if r.kv_cache_dtype == "auto" or r.name != "hf":
        return []
    rule = f"rollout.name = {r.name!r} has no 8-bit KV cache"
    return [
        Problem("rollout.kv_cache_dtype", r.kv_cache_dtype, rule, "use rollout.name = 'native' or 'sglang', or 'auto'")
    ]
