"""The rules that join the keys of the run and its algorithm: something to train on, a checkpoint
to resume from, the reward options, the policy loss (TIS, GSPO's clip), dynamic sampling and the
engine's KV cache. The code that reads these keys takes them as given.
"""

from __future__ import annotations

from minirl.config.load import Config
from minirl.validate.problem import Problem, value


def steps_problems(cfg: Config, pm) -> list[Problem]:
    """Some steps to train, training data, and validation data when the run validates."""
    t, out = cfg.trainer, []
    if t.total_training_steps == 0 and t.total_epochs == 0:
        rule = "zero epochs and trainer.total_training_steps = 0 train nothing"
        fix = "set trainer.total_epochs >= 1 or trainer.total_training_steps > 0"
        out.append(Problem("trainer.total_epochs", 0, rule, fix))
    if (t.test_freq > 0 or t.val_before_train) and not cfg.data.val_files:
        key = "trainer.test_freq" if t.test_freq > 0 else "trainer.val_before_train"
        fix = "list parquet files in data.val_files, or set test_freq = -1 and val_before_train = false"
        out.append(Problem(key, value(cfg, key), "validation needs data.val_files", fix))
    if not cfg.data.train_files:
        fix = "list parquet files (make data writes data/*/train.parquet)"
        out.append(Problem("data.train_files", [], "no training data", fix))
    return out


def resume_problems(cfg: Config, pm) -> list[Problem]:
    t = cfg.trainer
    if t.resume_mode == "resume_path" and not t.resume_from_path:
        rule = "trainer.resume_mode = 'resume_path' needs it"
        fix = "set it to a checkpoint directory, or use resume_mode = 'auto'"
        return [Problem("trainer.resume_from_path", t.resume_from_path, rule, fix)]
    return []


def reward_problems(cfg: Config, pm) -> list[Problem]:
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


def policy_loss_problems(cfg: Config, pm) -> list[Problem]:
    """TIS needs the engine's log-probs; GSPO's lower clip bound 1 − clip_ratio_low must be > 0.
    (Each clip range's own sign and clip_ratio_c > 1 are one-key rules: minirl.validate.values.)"""
    a, out = cfg.actor, []
    if a.tis_imp_ratio_cap > 0 and not cfg.rollout.calculate_log_probs:
        rule = (
            "truncated importance sampling reweights by the rollout engine's sampled-token log-probs, "
            "and rollout.calculate_log_probs = false keeps none"
        )
        fix = "set rollout.calculate_log_probs = true (the native, hf and sglang engines return them), or -1 (off)"
        out.append(Problem("actor.tis_imp_ratio_cap", a.tis_imp_ratio_cap, rule, fix))
    if a.policy_loss == "gspo" and a.clip_ratio_low is not None and a.clip_ratio_low >= 1:
        rule = "gspo clips the sequence ratio at 1 - clip_ratio_low, which must stay > 0"
        fix = "leave it unset (GSPO's 3e-4), or use a value in [0, 1)"
        out.append(Problem("actor.clip_ratio_low", a.clip_ratio_low, rule, fix))
    return out


def filter_groups_problems(cfg: Config, pm) -> list[Problem]:
    """Dynamic sampling compares the n samples of a group, before the KL penalty is applied."""
    fg = cfg.algorithm.filter_groups
    if not fg.enable:
        return []
    if cfg.rollout.n < 2:
        rule = "algorithm.filter_groups.enable = true compares the samples of a prompt; one has no spread"
        return [Problem("rollout.n", cfg.rollout.n, rule, "use rollout.n >= 2, or turn filter_groups off")]
    if fg.metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
        rule = "the KL penalty (algorithm.use_kl_in_reward) needs log-probs computed after the filter"
        return [Problem("algorithm.filter_groups.metric", fg.metric, rule, "use 'seq_reward' or 'score'")]
    return []


def kv_cache_problems(cfg: Config, pm) -> list[Problem]:
    """The hf engine has no 8-bit KV cache (transformers' cache keeps the model dtype) and no fp8
    GEMMs; the native and sglang engines have both, and an engine from another plugin reads the
    keys itself."""
    r = cfg.rollout
    if r.name != "hf":
        return []
    out = []
    if r.kv_cache_dtype != "auto":
        rule, fix = (
            f"rollout.name = {r.name!r} has no 8-bit KV cache",
            "use rollout.name = 'native' or 'sglang', or 'auto'",
        )
        out.append(Problem("rollout.kv_cache_dtype", r.kv_cache_dtype, rule, fix))
    if r.quantization != "none":
        rule, fix = f"rollout.name = {r.name!r} has no fp8 GEMMs", "use rollout.name = 'native' or 'sglang', or 'none'"
        out.append(Problem("rollout.quantization", r.quantization, rule, fix))
    return out


def multi_turn_problems(cfg: Config, pm) -> list[Problem]:
    """Tools need multi_turn.enable and a tool file; tool_agent needs multi_turn.enable."""
    mt, out = cfg.rollout.multi_turn, []
    if mt.enable and not mt.tool_config_path:
        rule = "rollout.multi_turn.enable = true runs tools, and no tool config file is given"
        fix = "point it at a YAML file listing the tools (examples/tools/tool_config.yaml), or set enable = false"
        out.append(Problem("rollout.multi_turn.tool_config_path", "", rule, fix))
    loop = cfg.rollout.agent.default_agent_loop
    if loop == "tool_agent" and not mt.enable:
        rule = "tool_agent calls tools, and rollout.multi_turn.enable = false loads none"
        fix = "set rollout.multi_turn.enable = true (and tool_config_path), or use 'single_turn'"
        out.append(Problem("rollout.agent.default_agent_loop", loop, rule, fix))
    return out


def async_problems(cfg: Config, pm) -> list[Problem]:
    """Asynchronous training: rollout ranks besides the trainer's, whole mini-batches per step, the
    behaviour policy's log-probs, and nothing that needs a step to draw more prompts."""
    a, r, t = cfg.async_training, cfg.rollout, cfg.trainer
    if not a.enable:
        return []
    rollout, out = cfg.rollout_world, []
    if rollout < 1:
        rule = "asynchronous training needs rollout ranks of its own"
        fix = "set it to the rollout GPUs per node (on CPU: the rollout processes among trainer.world_size)"
        return [Problem("rollout.n_gpus_per_node", r.n_gpus_per_node, rule, fix)]
    if t.device != "cuda" and t.world_size <= rollout:
        rule = f"counts every process on CPU, the {rollout} rollout process(es) included, so none would train"
        out.append(Problem("trainer.world_size", t.world_size, rule, f"use at least {rollout + 1}"))
    steps = a.require_batches * cfg.actor.ppo_mini_batch_size
    if cfg.data.train_batch_size != steps:
        rule = (
            f"a trainer step takes require_batches x actor.ppo_mini_batch_size = {steps} prompts, and "
            f"data.train_batch_size = {cfg.data.train_batch_size}"
        )
        fix = f"set data.train_batch_size = {steps}, or require_batches = data.train_batch_size / ppo_mini_batch_size"
        out.append(Problem("async_training.require_batches", a.require_batches, rule, fix))
    if not r.calculate_log_probs:
        rule = "asynchronous training needs the behaviour policy's log-probs (the rollout engine's)"
        out.append(Problem("rollout.calculate_log_probs", False, rule, "set it to true"))
    if not (a.use_rollout_log_probs or a.compute_prox_log_prob):
        rule = "the old log-probs must be the rollout's (bypass) or the trainer's proximal ones"
        fix = "keep use_rollout_log_probs = true, or set compute_prox_log_prob = true"
        out.append(Problem("async_training.use_rollout_log_probs", False, rule, fix))
    if a.compute_prox_log_prob and cfg.actor.tis_imp_ratio_cap <= 0:
        rule = "decoupled PPO clips against the proximal policy and needs the behaviour weight, which is off"
        fix = "set actor.tis_imp_ratio_cap (e.g. 2.0), or compute_prox_log_prob = false (bypass mode)"
        out.append(Problem("async_training.compute_prox_log_prob", True, rule, fix))
    if cfg.algorithm.filter_groups.enable:
        rule = "dynamic sampling draws more prompt batches within a step; the rollout ranks draw them ahead"
        out.append(Problem("algorithm.filter_groups.enable", True, rule, "turn off async_training or filter_groups"))
    return out
