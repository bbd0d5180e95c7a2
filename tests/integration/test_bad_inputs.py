"""The catalogue of user mistakes: each is one clear error line, exit status 2, no traceback.

A new user tries minirl with bad config values, data files, model directories, plugins and
rewards; none of these may end in a traceback, a library's message that names no key, or a run
that "succeeded" on nonsense. Every case here runs the real command line
(`minirl.cli.main(argv)`, in this process; the few that need a real process or a signal run as
subprocesses) and asserts the exit status, that the error line names the culprit (key, value,
file or plugin) and that stderr holds no traceback. Most cases stop in the validation pass, so
the whole catalogue takes well under a minute or two.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from minirl.cli import main
from tests.integration.conftest import ROOT

BENCH = str(ROOT / "bench.toml")


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def base(data_dir, tmp_path):
    """argv of a tiny valid job (1 step, 2 prompts x 2 samples); a case appends its mistake."""
    return [
        "--config",
        BENCH,
        "--profile",
        "cpu",
        f'data.train_files=["{data_dir}/copy/train.parquet"]',
        f'data.val_files=["{data_dir}/copy/test.parquet"]',
        f"trainer.default_local_dir={tmp_path / 'runs'}",
        "trainer.progress_bar=false",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.total_training_steps=1",
        "data.train_batch_size=2",
        "actor.ppo_mini_batch_size=2",
        "rollout.n=2",
        "data.max_response_length=2",
        'trainer.logger=["jsonl"]',
        "actor.use_kl_loss=false",
    ]


def fails(capsys, argv: list[str], *needles: str, lines: int | None = 1) -> str:
    """Run the CLI; assert status 2, no traceback, and `lines` error lines naming every needle."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err, err
    assert "minirl: error:" in err, err
    message = err[err.index("minirl: error:") :]
    if lines is not None:
        assert len(message.strip().splitlines()) == lines, message
    for needle in needles:
        assert needle in message, f"{needle!r} not in: {message}"
    return message


def write_rows(path: Path, rows: list[dict] | None = None, **columns) -> str:
    """A parquet file in verl's schema: `rows` of good copy-task rows, or explicit columns."""
    if columns:
        pq.write_table(pa.table(columns), path)
        return str(path)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def good_row(i: int = 0, **changes) -> dict:
    row = {
        "data_source": "copy",
        "prompt": [{"role": "user", "content": f"Repeat the digit {i % 10} twice."}],
        "ability": "copy",
        "reward_model": {"style": "rule", "ground_truth": str(i % 10) * 2},
        "extra_info": {"index": i},
    }
    row.update(changes)
    return row


def files_override(path: str) -> str:
    return f'data.train_files=["{path}"]'


# ---------------------------------------------------------------------------------------------
# config values (validation pass: nothing is loaded)
# ---------------------------------------------------------------------------------------------

CONFIG_CASES = {
    "batch_zero": (["data.train_batch_size=0"], "data.train_batch_size = 0", "at least 1"),
    "batch_negative": (["data.train_batch_size=-4"], "data.train_batch_size = -4"),
    "batch_larger_than_data": (["data.train_batch_size=4000", "actor.ppo_mini_batch_size=4000"], "rows"),
    "mini_zero": (["actor.ppo_mini_batch_size=0"], "actor.ppo_mini_batch_size = 0"),
    "mini_negative": (["actor.ppo_mini_batch_size=-2"], "actor.ppo_mini_batch_size = -2"),
    "mini_larger_than_batch": (["actor.ppo_mini_batch_size=4"], "actor.ppo_mini_batch_size = 4", "larger than"),
    "mini_not_dividing": (["data.train_batch_size=6", "actor.ppo_mini_batch_size=4"], "does not divide"),
    "micro_zero": (["actor.ppo_micro_batch_size_per_gpu=0"], "actor.ppo_micro_batch_size_per_gpu = 0"),
    "rollout_micro_zero": (["rollout.log_prob_micro_batch_size_per_gpu=0"], "rollout.log_prob_micro_batch_size"),
    "ref_micro_zero": (["ref.log_prob_micro_batch_size_per_gpu=0"], "ref.log_prob_micro_batch_size_per_gpu = 0"),
    "token_budget_below_sequence": (["actor.ppo_max_token_len_per_gpu=10"], "actor.ppo_max_token_len_per_gpu = 10"),
    "ref_token_budget": (
        ["ref.log_prob_use_dynamic_bsz=true", "ref.log_prob_max_token_len_per_gpu=10"],
        "ref.log_prob_max_token_len_per_gpu = 10",
        "smaller than one sequence",
    ),
    # with Ulysses each rank holds 1/sp of a micro-batch: the budget per GPU times sp must hold a sequence
    "token_budget_below_sequence_under_sp": (
        [
            "trainer.world_size=2",
            "actor.ulysses_sequence_parallel_size=2",
            "rollout.log_prob_use_dynamic_bsz=true",
            "rollout.log_prob_max_token_len_per_gpu=10",
        ],
        "rollout.log_prob_max_token_len_per_gpu = 10",
        "x actor.ulysses_sequence_parallel_size 2 = 20 tokens",
    ),
    "epochs_zero": (["actor.ppo_epochs=0"], "actor.ppo_epochs = 0"),
    "loss_agg_mode": (["actor.loss_agg_mode=token_mean"], "actor.loss_agg_mode = 'token_mean'", "token-mean"),
    "kl_ctrl_type": (["algorithm.kl_ctrl.type=fixd"], "algorithm.kl_ctrl.type = 'fixd'", "fixed"),
    "clip_ratio_negative": (["actor.clip_ratio=-0.2"], "actor.clip_ratio = -0.2"),
    "clip_ratio_c_one": (["actor.clip_ratio_c=1.0"], "actor.clip_ratio_c = 1.0"),
    "clip_ratio_high_negative": (["actor.clip_ratio_high=-0.1"], "actor.clip_ratio_high = -0.1", ">= 0"),
    "grad_clip_zero": (["actor.grad_clip=0.0"], "actor.grad_clip = 0.0"),
    "tis_cap_zero": (["actor.tis_imp_ratio_cap=0.0"], "actor.tis_imp_ratio_cap = 0.0", "-1 (off)"),
    "tis_cap_minus_two": (["actor.tis_imp_ratio_cap=-2.0"], "actor.tis_imp_ratio_cap = -2.0"),
    "tis_without_rollout_log_probs": (
        ["actor.tis_imp_ratio_cap=2.0", "rollout.calculate_log_probs=false"],
        "actor.tis_imp_ratio_cap = 2.0",
        "rollout.calculate_log_probs = true",
    ),
    "gspo_clip_low_one": (
        ["actor.policy_loss=gspo", "actor.clip_ratio_low=1.0"],
        "actor.clip_ratio_low = 1.0",
        "gspo",
    ),
    "entropy_nan": (["actor.entropy_coeff=nan"], "actor.entropy_coeff = nan", "finite"),
    "lr_negative": (["actor.optim.lr=-1e-6"], "actor.optim.lr = -1e-06"),
    "lr_nan": (["actor.optim.lr=nan"], "actor.optim.lr = nan"),
    "lr_inf": (["actor.optim.lr=inf"], "actor.optim.lr = inf"),
    "betas": (["actor.optim.betas=[0.9]"], "actor.optim.betas = [0.9]"),
    "warmup_style": (["actor.optim.warmup_style=linear"], "actor.optim.warmup_style = 'linear'"),
    "n_zero": (["rollout.n=0"], "rollout.n = 0"),
    "n_negative": (["rollout.n=-1"], "rollout.n = -1"),
    "temperature_negative": (["rollout.temperature=-1.0"], "rollout.temperature = -1.0"),
    "top_p_zero": (["rollout.top_p=0.0"], "rollout.top_p = 0.0", "(0, 1]"),
    "top_p_above_one": (["rollout.top_p=1.5"], "rollout.top_p = 1.5"),
    "max_response_zero": (["data.max_response_length=0"], "data.max_response_length = 0"),
    "max_prompt_zero": (["data.max_prompt_length=0"], "data.max_prompt_length = 0"),
    "truncation": (["data.truncation=both"], "data.truncation = 'both'"),
    "gpu_memory_zero": (["rollout.gpu_memory_utilization=0.0"], "rollout.gpu_memory_utilization"),
    "model_dtype_fp32": (["model.dtype=fp32"], "model.dtype = 'fp32'", "float32"),
    "rollout_dtype": (["rollout.dtype=half"], "rollout.dtype = 'half'"),
    "kv_cache_dtype": (["rollout.kv_cache_dtype=fp16"], "rollout.kv_cache_dtype = 'fp16'", "fp8_e5m2"),
    "kv_cache_dtype_hf": (
        ["rollout.name=hf", "rollout.kv_cache_dtype=fp8"],
        "rollout.kv_cache_dtype = 'fp8'",
        "has no 8-bit KV cache",
    ),
    "quantization": (["rollout.quantization=int8"], "rollout.quantization = 'int8'", "fp8"),
    "quantization_hf": (
        ["rollout.name=hf", "rollout.quantization=fp8"],
        "rollout.quantization = 'fp8'",
        "no fp8 GEMMs",
    ),
    "model_preset": (["model.preset=tiny2"], "model.preset = 'tiny2'", "qwen2-1.5b"),
    "device_tpu": (["trainer.device=tpu"], "trainer.device = 'tpu'"),
    "world_size_zero": (["trainer.world_size=0"], "trainer.world_size = 0"),
    "n_gpus_zero": (["trainer.n_gpus_per_node=0"], "trainer.n_gpus_per_node = 0"),
    "nnodes_two_local": (["trainer.nnodes=2", "trainer.launcher=local"], "trainer.nnodes = 2", "launcher = 'ray'"),
    "nnodes_zero": (["trainer.nnodes=0"], "trainer.nnodes = 0"),
    "nnodes_not_dividing_cpu_workers": (["trainer.nnodes=2", "trainer.world_size=1"], "trainer.world_size = 1"),
    "launcher_typo": (["trainer.launcher=rey"], "trainer.launcher = 'rey'", "auto, local, ray, torchrun"),
    "torchrun_without_torchrun": (["trainer.launcher=torchrun"], "trainer.launcher = 'torchrun'", "RANK"),
    "ray_timeout_zero": (["trainer.ray_placement_timeout_s=0"], "trainer.ray_placement_timeout_s = 0"),
    "ray_address_unused": (
        ["trainer.launcher=local", "trainer.ray_address='10.0.0.1:6379'"],
        "trainer.ray_address = '10.0.0.1:6379'",
        "unused",
    ),
    "sp_in_world_of_one": (["actor.ulysses_sequence_parallel_size=2"], "actor.ulysses_sequence_parallel_size = 2"),
    "ref_sp": (["ref.ulysses_sequence_parallel_size=3"], "ref.ulysses_sequence_parallel_size = 3"),
    "steps_minus_one": (["trainer.total_training_steps=-1"], "trainer.total_training_steps = -1"),
    "zero_total_steps": (["trainer.total_training_steps=0", "trainer.total_epochs=0"], "trainer.total_epochs = 0"),
    "test_freq_without_val": (["trainer.test_freq=1", "data.val_files=[]"], "trainer.test_freq = 1", "val_files"),
    "no_train_files": (["data.train_files=[]"], "data.train_files = []"),
    "gamma_above_one": (["algorithm.gamma=2.0"], "algorithm.gamma = 2.0"),
    "kl_coef_negative": (["actor.kl_loss_coef=-0.1"], "actor.kl_loss_coef = -0.1"),
    "kl_target_zero": (["algorithm.kl_ctrl.target_kl=0.0"], "algorithm.kl_ctrl.target_kl = 0.0", "divides by it"),
    "max_nonfinite_zero": (["trainer.max_nonfinite_steps=0"], "trainer.max_nonfinite_steps = 0"),
    "resume_mode": (["trainer.resume_mode=always"], "trainer.resume_mode = 'always'"),
    "resume_path_without_path": (["trainer.resume_mode=resume_path"], "trainer.resume_from_path = ''"),
    "max_ckpt_negative": (["trainer.max_ckpt_to_keep=-1"], "trainer.max_ckpt_to_keep = -1"),
    "estimator_typo": (["algorithm.adv_estimator=grpoo"], "algorithm.adv_estimator = 'grpoo'", "did you mean 'grpo'"),
    "policy_loss_typo": (["actor.policy_loss=vanila"], "no such policy loss", "; registered: gspo, vanilla"),
    "kl_loss_type": (["actor.use_kl_loss=true", "actor.kl_loss_type=k9"], "actor.kl_loss_type = 'k9'"),
    "kl_penalty_full": (
        ["algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=full"],
        "algorithm.kl_penalty = 'full'",
        "needs whole logits",
    ),
    "engine_name": (["rollout.name=vllm"], "rollout.name = 'vllm'", "no such rollout engine"),
    "logger_name": (['trainer.logger=["consol"]'], "trainer.logger[0] = 'consol'", "console"),
    "empty_experiment_name": (['trainer.experiment_name=""'], "trainer.experiment_name"),
    "reward_workers_negative": (["reward.num_workers=-1"], "reward.num_workers = -1"),
    "reward_timeout_zero": (["reward.timeout_s=0"], "reward.timeout_s = 0.0", "> 0"),
    "reward_manager_typo": (["reward.reward_manager=batched"], "reward.reward_manager = 'batched'", "'batch'"),
    "batch_manager_without_function": (
        ["reward.reward_manager=batch"],
        "reward.reward_manager = 'batch'",
        "custom_reward_function.path",
    ),
    "overlong_len_zero": (["reward.overlong_buffer.enable=true"], "reward.overlong_buffer.len = 0", "(0, "),
    "overlong_len_whole_response": (
        ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=2"],
        "reward.overlong_buffer.len = 2",
        "data.max_response_length = 2",
    ),
    "overlong_factor_negative": (
        ["reward.overlong_buffer.penalty_factor=-1.0"],
        "reward.overlong_buffer.penalty_factor = -1.0",
    ),
    "filter_groups_metric": (["algorithm.filter_groups.metric=acc"], "algorithm.filter_groups.metric = 'acc'", "score"),
    "filter_groups_one_sample": (["algorithm.filter_groups.enable=true", "rollout.n=1"], "rollout.n = 1", "spread"),
    "filter_groups_final_reward_with_kl": (
        [
            "algorithm.filter_groups.enable=true",
            "algorithm.filter_groups.metric=seq_final_reward",
            "algorithm.use_kl_in_reward=true",
        ],
        "algorithm.filter_groups.metric = 'seq_final_reward'",
        "use_kl_in_reward",
    ),
    # the [critic] rules apply when the estimator trains a critic (gae)
    "critic_mini_not_dividing": (
        [
            "algorithm.adv_estimator=gae",
            "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=4",
            "critic.ppo_mini_batch_size=3",
        ],
        "critic.ppo_mini_batch_size = 3",
        "does not divide data.train_batch_size = 4",
    ),
    "critic_mini_over_ranks": (
        ["algorithm.adv_estimator=gae", "trainer.world_size=2", "critic.ppo_mini_batch_size=1"],
        "critic.ppo_mini_batch_size = 1",
        "2 data-parallel ranks",
    ),
    "critic_token_budget": (
        ["algorithm.adv_estimator=gae", "critic.use_dynamic_bsz=true", "critic.ppo_max_token_len_per_gpu=10"],
        "critic.ppo_max_token_len_per_gpu = 10",
    ),
    "critic_forward_budget": (
        ["algorithm.adv_estimator=gae", "critic.use_dynamic_bsz=true", "critic.forward_max_token_len_per_gpu=10"],
        "critic.forward_max_token_len_per_gpu = 10",
    ),
    "critic_forward_micro_zero": (
        ["algorithm.adv_estimator=gae", "critic.forward_micro_batch_size_per_gpu=0"],
        "critic.forward_micro_batch_size_per_gpu = 0",
    ),
    "critic_epochs_zero": (["algorithm.adv_estimator=gae", "critic.ppo_epochs=0"], "critic.ppo_epochs = 0"),
    "critic_cliprange_zero": (["algorithm.adv_estimator=gae", "critic.cliprange_value=0.0"], "critic.cliprange_value"),
    "critic_loss_agg_mode": (
        ["algorithm.adv_estimator=gae", "critic.loss_agg_mode=token_mean"],
        "critic.loss_agg_mode = 'token_mean'",
        "token-mean",
    ),
    "critic_lr_negative": (["algorithm.adv_estimator=gae", "critic.optim.lr=-1.0"], "critic.optim.lr = -1.0"),
    "critic_warmup_negative": (["algorithm.adv_estimator=gae", "trainer.critic_warmup=-1"], "trainer.critic_warmup"),
    "critic_sp": (
        ["algorithm.adv_estimator=gae", "critic.ulysses_sequence_parallel_size=3"],
        "critic.ulysses_sequence_parallel_size = 3",
    ),
    "critic_model_path": (
        ["algorithm.adv_estimator=gae", "critic.model.path=/no/such/model"],
        "critic.model.path = '/no/such/model'",
    ),
    # multi-turn rollouts (docs/agents.md)
    "agent_loop_unknown": (["rollout.agent.default_agent_loop=tool_agnt"], "default_agent_loop", "tool_agent"),
    "tool_agent_without_multi_turn": (
        ["rollout.agent.default_agent_loop=tool_agent"],
        "rollout.agent.default_agent_loop = 'tool_agent'",
        "multi_turn.enable = true",
    ),
    "multi_turn_without_tool_file": (["rollout.multi_turn.enable=true"], "tool_config_path", "examples/tools"),
    "tool_file_missing": (
        ["rollout.multi_turn.enable=true", "rollout.multi_turn.tool_config_path=/no/such/tools.yaml"],
        "rollout.multi_turn.tool_config_path = '/no/such/tools.yaml'",
    ),
    "tool_format_unknown": (["rollout.multi_turn.format=json"], "rollout.multi_turn.format = 'json'", "hermes"),
    "truncate_side_unknown": (
        ["rollout.multi_turn.tool_response_truncate_side=both"],
        "tool_response_truncate_side = 'both'",
        "middle",
    ),
    "parallel_calls_zero": (["rollout.multi_turn.max_parallel_calls=0"], "max_parallel_calls = 0"),
    "assistant_turns_zero": (["rollout.multi_turn.max_assistant_turns=0"], "max_assistant_turns = 0"),
    "tokens_per_turn_zero": (["rollout.multi_turn.max_tokens_per_turn=0"], "max_tokens_per_turn = 0"),
    # asynchronous training (docs/async.md)
    "async_without_rollout_ranks": (["async_training.enable=true"], "rollout.n_gpus_per_node = 0", "rollout ranks"),
    "async_world_all_rollout": (
        ["async_training.enable=true", "rollout.n_gpus_per_node=1", "trainer.world_size=1"],
        "trainer.world_size = 1",
        "at least 2",
    ),
    "async_require_batches": (
        ["async_training.enable=true", "rollout.n_gpus_per_node=1", "trainer.world_size=2"]
        + ["async_training.require_batches=2"],
        "async_training.require_batches = 2",
        "data.train_batch_size",
    ),
    "async_without_log_probs": (
        ["async_training.enable=true", "rollout.n_gpus_per_node=1", "trainer.world_size=2"]
        + ["rollout.calculate_log_probs=false"],
        "rollout.calculate_log_probs = False",
    ),
    "async_prox_without_cap": (
        ["async_training.enable=true", "rollout.n_gpus_per_node=1", "trainer.world_size=2"]
        + ["async_training.compute_prox_log_prob=true"],
        "compute_prox_log_prob = True",
        "tis_imp_ratio_cap",
    ),
    "async_staleness_negative": (["async_training.staleness_threshold=-1"], "staleness_threshold = -1"),
    "async_trigger_zero": (["async_training.trigger_parameter_sync_step=0"], "trigger_parameter_sync_step = 0"),
    # LoRA (model.lora_*): the values, then the modules they name (the model built on the meta device)
    "lora_alpha_without_rank": (["model.lora_alpha=32"], "model.lora_alpha = 32", "LoRA is off", "lora_rank > 0"),
    "lora_rank_negative": (["model.lora_rank=-8"], "model.lora_rank = -8", ">= 0"),
    "lora_alpha_zero": (["model.lora_rank=8", "model.lora_alpha=0"], "model.lora_alpha = 0", "> 0"),
    "lora_dropout_one": (["model.lora_rank=8", "model.lora_dropout=1.0"], "model.lora_dropout = 1.0", "[0, 1)"),
    "lora_target_regex_invalid": (
        ["model.lora_rank=8", "model.target_modules=(proj"],
        "model.target_modules",
        "regular",
    ),
    "lora_target_unknown": (
        ["model.lora_rank=8", 'model.target_modules=["q_proj", "gate"]'],
        "model.target_modules",
        "'gate' names no linear layer",
        "gate_proj",
    ),
    "lora_target_lm_head": (
        ["model.lora_rank=8", 'model.target_modules=["q_proj", "lm_head"]'],
        "'lm_head' cannot carry an adapter",
        "log-prob head",
    ),
    "lora_target_regex_matches_nothing": (
        ["model.lora_rank=8", "model.target_modules=.*qkv.*"],
        "model.target_modules = '.*qkv.*'",
        "matches no linear layer",
    ),
    "lora_adapter_path_missing": (
        ["model.lora_adapter_path=/no/such/adapter"],
        "model.lora_adapter_path = '/no/such/adapter'",
        "no such directory",
    ),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_config_value_is_one_line(capsys, base, case):
    """Each invalid config value stops the run before any model loads, on one line that names
    the key, the value, where it came from (here: the command line) and the fix."""
    overrides, *needles = CONFIG_CASES[case]
    fails(capsys, base + overrides, *needles)


def test_batches_that_do_not_divide_over_ranks(capsys, base):
    """At world size 2 an odd batch (and so an odd mini-batch) cannot be split into whole prompts."""
    argv = base + ["trainer.world_size=2", "data.train_batch_size=3", "actor.ppo_mini_batch_size=3"]
    fails(capsys, argv, "data.train_batch_size = 3", "actor.ppo_mini_batch_size = 3", "2 data-parallel", lines=3)


def test_cuda_without_cuda(capsys, base):
    """trainer.device = 'cuda' on a machine without CUDA is a config error, not a torch crash."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    fails(capsys, base + ["trainer.device=cuda"], "trainer.device = 'cuda'", "CUDA is not available")


def test_every_invalid_value_is_reported_at_once(capsys, base):
    """One run reports all its mistakes, one line each, instead of one per attempt."""
    bad = ["rollout.n=0", "actor.optim.lr=nan", "trainer.device=tpu", "actor.ppo_epochs=0"]
    msg = fails(capsys, base + bad, "4 invalid config values", "rollout.n", "actor.optim.lr", lines=5)
    assert "trainer.device" in msg and "actor.ppo_epochs" in msg


def test_unknown_keys_and_invalid_values_in_one_error(capsys, base):
    """Unknown keys, a wrong type and invalid values of one command line (or file) come in one
    error, one line each, not one per attempt; the key of the wrong type is not reported a
    second time at the default that stood in for it."""
    bad = ["actor.zzzzzz=2", "trainer.experiment_nam=x", "rollout.n=0", "actor.ppo_epochs=two", "model.lora_alpha=8"]
    msg = fails(capsys, base + bad, "5 invalid config values", "unknown key actor.zzzzzz", lines=6)
    for needle in ("experiment_name", "rollout.n = 0", "actor.ppo_epochs must be int", "model.lora_alpha = 8"):
        assert needle in msg
    assert msg.count("ppo_epochs") == 1


def test_lora_keys_at_their_defaults_pass_with_lora_off(capsys, base):
    """--print-config writes every LoRA key at its default; running that file must not refuse
    them (only a value that would change something while lora_rank = 0 is a mistake)."""
    defaults = ["model.lora_alpha=16", 'model.target_modules="all-linear"', "model.exclude_modules=[]"]
    assert main(base + defaults + ["model.lora_dropout=0.0", "model.lora_save_merged=false", "--print-config"]) == 0
    two = ["model.lora_alpha=32", "model.lora_dropout=0.1"]
    fails(capsys, base + two, "model.lora_alpha = 32", "model.lora_dropout = 0.1", lines=3)


def test_source_names_the_file_and_profile(capsys, tmp_path, base):
    """The error says which layer set the value: a profile table of the config file."""
    cfg = tmp_path / "job.toml"
    cfg.write_text(Path(BENCH).read_text() + "\n[profiles.bad.actor]\nppo_epochs = 0\n")
    argv = ["--config", str(cfg), "--profile", "bad"] + base[4:]
    fails(capsys, argv, "actor.ppo_epochs = 0", f"({cfg} [profiles.bad])")


def test_print_config_validates_too(capsys, base):
    """--print-config must not print a config whose values would fail to run (its files are
    not checked: a config may be printed where the data is not)."""
    fails(capsys, base + ["--print-config", "rollout.n=0"], "rollout.n = 0")


# ---------------------------------------------------------------------------------------------
# the config file and the command line itself
# ---------------------------------------------------------------------------------------------


def test_unknown_key_suggests_the_closest(capsys, base):
    msg = fails(capsys, base + ["actor.ppo_epoch=2"], "did you mean 'actor.ppo_epochs'")
    assert "valid keys" not in msg


def test_unknown_key_without_a_close_one_does_not_list_every_key(capsys, base):
    """No wall of 30 keys: the line points at --print-config instead."""
    msg = fails(capsys, base + ["actor.zzzzzz=2"], "unknown key actor.zzzzzz", "--print-config")
    assert "actor.ppo_epochs" not in msg


def test_unknown_section(capsys, base):
    fails(capsys, base + ["rolout.n=2"], "unknown section [rolout]", "did you mean 'rollout'")


def test_wrong_type(capsys, base):
    fails(capsys, base + ["rollout.n=two"], "rollout.n must be int, got str 'two'")


LIST_CASES = {
    "module_bare": (
        "plugins.modules=my_estimators",
        "command line: plugins.modules must be a list, got str 'my_estimators'",
        """'plugins.modules=["my_estimators"]'""",
    ),
    "module_unquoted": (
        "plugins.modules=[my_estimators]",
        "command line: plugins.modules=[my_estimators] is not valid TOML",
        """'plugins.modules=["my_estimators"]'""",
    ),
    "logger_bare": (
        "trainer.logger=jsonl",
        "command line: trainer.logger must be a list",
        """'trainer.logger=["jsonl"]'""",
    ),
    "train_files_bare": ("data.train_files=a.parquet", "data.train_files must be a list", "data.train_files=["),
}


@pytest.mark.parametrize("case", sorted(LIST_CASES))
def test_a_string_for_a_list_key(capsys, base, case):
    """Every list key refuses a bare string (never splits it into characters, never imports a
    plugin module 'm'), from the command line as from a file, naming the key, the layer that set
    it and the override to write instead; a list whose strings lost their quotes in the shell too."""
    override, *needles = LIST_CASES[case]
    fails(capsys, base + [override], *needles)


def test_a_string_for_a_list_key_in_the_file(capsys, tmp_path, base):
    cfg = tmp_path / "job.toml"
    cfg.write_text(Path(BENCH).read_text().replace("[model]", '[plugins]\nmodules = "my_estimators"\n\n[model]', 1))
    argv = ["--config", str(cfg)] + base[2:]
    fails(capsys, argv, f"{cfg}: plugins.modules must be a list", 'modules = ["my_estimators"]')


def test_plugin_module_error_names_the_command_line(capsys, base):
    fails(capsys, base + ['plugins.modules=["tmp_plugin_absent"]'], "(plugins.modules on the command line)")


def test_override_without_equals(capsys, base):
    fails(capsys, base + ["rollout.n"], "'rollout.n' is not an override")


def test_config_is_a_directory(capsys, tmp_path):
    fails(capsys, ["--config", str(tmp_path)], f"--config {tmp_path}: is a directory")


def test_config_missing(capsys, tmp_path):
    fails(capsys, ["--config", str(tmp_path / "nope.toml")], "no such file")


def test_config_not_toml(capsys, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[actor\n")
    fails(capsys, ["--config", str(bad)], "not valid TOML")


def test_config_not_utf8(capsys, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"[actor]\nloss_agg_mode = '\xff'\n")
    fails(capsys, ["--config", str(bad)], "not UTF-8")


def test_missing_profile(capsys):
    fails(capsys, ["--config", BENCH, "--profile", "tpu"], "--profile 'tpu'", "available: 8xh100, cpu")


def test_output_directory_under_a_regular_file(capsys, tmp_path, base):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    fails(capsys, base + [f"trainer.default_local_dir={blocker / 'runs'}"], "trainer.default_local_dir", "is a file")


# ---------------------------------------------------------------------------------------------
# data files
# ---------------------------------------------------------------------------------------------


def test_train_file_missing(capsys, tmp_path, base):
    fails(capsys, base + [files_override(str(tmp_path / "absent.parquet"))], "absent.parquet", "no such file")


def test_train_file_is_a_directory(capsys, tmp_path, base):
    fails(capsys, base + [files_override(str(tmp_path))], "is a directory")


def test_train_file_not_parquet(capsys, tmp_path, base):
    path = tmp_path / "rows.parquet"
    path.write_text("data_source,prompt\ncopy,hi\n")
    fails(capsys, base + [files_override(str(path))], "rows.parquet", "cannot read as parquet")


def test_train_file_without_data_source(capsys, tmp_path, base):
    path = write_rows(tmp_path / "d.parquet", prompt=["x", "y"])
    fails(capsys, base + [files_override(path)], "d.parquet", "data_source")


def test_non_utf8_data_source(capsys, tmp_path, base):
    """Bytes that are not UTF-8 in a string column name the file, not a codec."""
    bad = pa.array([b"copy", b"\xff\xfe"], pa.binary()).view(pa.string())
    path = write_rows(tmp_path / "d.parquet", data_source=bad)
    fails(capsys, base + [files_override(path)], "d.parquet")


# the rest load past validation: the loader names file, row and field

DATA_CASES = {
    "no_reward_model_column": (lambda: {k: v for k, v in good_row().items() if k != "reward_model"}, "reward_model"),
    "prompt_not_a_list": (lambda: good_row(prompt="Repeat 3"), "field 'prompt' must be"),
    "prompt_empty": (lambda: good_row(prompt=[]), "empty list"),
    "message_without_role": (lambda: good_row(prompt=[{"content": "hi"}]), "message 0"),
    "ground_truth_missing": (lambda: good_row(reward_model={"style": "rule", "ground_truth": None}), "ground_truth"),
    "data_source_empty": (lambda: good_row(data_source=""), "data_source"),
    "extra_info_not_struct": (lambda: good_row(extra_info=[1, 2]), "field 'extra_info' must be"),
    "ability_not_string": (lambda: good_row(ability=3), "field 'ability' must be"),
}


@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_malformed_row_names_file_row_field(capsys, tmp_path, base, case):
    """A malformed row is named by file:row and field; rows 0-7 are fine, row 8 is bad."""
    make, needle = DATA_CASES[case]
    bad = make()
    rows = [{k: v for k, v in good_row(i).items() if k in bad} for i in range(8)] + [bad]
    try:
        table = pa.Table.from_pylist(rows)
    except (pa.ArrowTypeError, pa.ArrowInvalid):  # parquet cannot mix the types: every row is bad
        table, needle = pa.Table.from_pylist([bad] * 4), f"d.parquet:0: field {needle.split()[1]}"
    pq.write_table(table, tmp_path / "d.parquet")
    fails(capsys, base + [files_override(str(tmp_path / "d.parquet"))], "d.parquet", needle)


def test_prompt_column_not_utf8(capsys, tmp_path, base):
    rows = [good_row(i) for i in range(4)]
    path = tmp_path / "d.parquet"
    table = pa.Table.from_pylist(rows)
    ability = pa.array([b"copy", b"copy", b"\xff", b"copy"], pa.binary()).view(pa.string())
    table = table.set_column(table.column_names.index("ability"), "ability", ability)
    pq.write_table(table, path)
    fails(capsys, base + [files_override(str(path))], "d.parquet:2", "'ability'", "not UTF-8")


def test_all_prompts_overlong(capsys, tmp_path, base):
    fails(capsys, base + ["data.max_prompt_length=2"], "no prompts left", "data.max_prompt_length")


def test_overlong_prompt_with_truncation_error(capsys, base):
    fails(capsys, base + ["data.max_prompt_length=20", "data.filter_overlong_prompts=false"], "max_prompt_length = 20")


def test_batch_larger_than_prompts_left_after_filtering(capsys, tmp_path, base):
    """Validation counts rows; the loader counts what survives the length filter."""
    rows = [good_row(i) for i in range(3)] + [good_row(9, prompt=[{"role": "user", "content": "x" * 200}])]
    path = write_rows(tmp_path / "d.parquet", rows)
    fails(
        capsys,
        base + [files_override(path), "data.train_batch_size=4", "actor.ppo_mini_batch_size=4"],
        "data.train_batch_size = 4",
        "3 prompts",
    )


def test_empty_file(capsys, tmp_path, base):
    path = write_rows(tmp_path / "d.parquet", [good_row(0)])
    pq.write_table(pq.read_table(path).slice(0, 0), path)
    fails(capsys, base + [files_override(path)], "d.parquet", "no rows")


# ---------------------------------------------------------------------------------------------
# rewards
# ---------------------------------------------------------------------------------------------


def test_unknown_data_source_is_found_before_training(capsys, tmp_path, base):
    """Every data_source needs a reward function: checked at start, not at the step that meets it."""
    rows = [good_row(i) for i in range(50)] + [good_row(50, data_source="my_task")]
    path = write_rows(tmp_path / "d.parquet", rows)
    fails(capsys, base + [files_override(path)], "data_source 'my_task' (row 50)", "no reward function", "copy")


def test_unknown_data_source_in_validation_files(capsys, tmp_path, base):
    path = write_rows(tmp_path / "v.parquet", [good_row(0, data_source="gsm9k")])
    fails(capsys, base + [f'data.val_files=["{path}"]', "trainer.val_before_train=true"], "data.val_files", "gsm9k")


def test_data_source_of_a_plugin_reward_is_accepted(capsys, tmp_path, base, plugin_dir):
    """The check reads the registry, so a plugin's reward function counts (print-config only)."""
    module = plugin_dir(
        "tmp_plugin_reward",
        """
        from minirl import hookimpl
        @hookimpl
        def minirl_reward_functions():
            return {"my_task": lambda text, truth, extra: float(text == truth)}
        """,
    )
    path = write_rows(tmp_path / "d.parquet", [good_row(i, data_source="my_task") for i in range(4)])
    code = main(base + [files_override(path), f'plugins.modules=["{module}"]', "--print-config"])
    assert code == 0, capsys.readouterr().err


def test_reward_manager_error_is_a_user_error():
    """Scoring a record whose data_source has no function is a UserError (one line), not a
    ValueError traceback, when a trainer meets it."""
    from minirl.errors import UserError
    from minirl.reward.manager import RewardManager

    class Rec:
        data_source, source = "nope", "f.parquet:3"

    with pytest.raises(UserError, match=r"f.parquet:3: data_source 'nope' has no reward function"):
        RewardManager({"copy": None}).score([Rec()], ["x"])


CUSTOM_REWARD_CASES = {
    "syntax_error": ("x = 1\ndef compute_score(:\n", "custom_reward_function.path", "r.py:2", "SyntaxError"),
    "import_error": ("import os\nimport not_a_package_xyz\n", "r.py:2", "not_a_package_xyz", "install"),
    "raises_at_import": ("raise KeyError('token')\n", "r.py:1", "KeyError"),
    "missing_function": ("def score(): pass\n", "custom_reward_function.name = 'compute_score'", "defines no"),
    "not_callable": ("compute_score = {}\n", "is a dict, not a function"),
    "wrong_parameters": ("def compute_score(text, truth):\n    return 0.0\n", "data_source, solution_str"),
}


@pytest.mark.parametrize("case", sorted(CUSTOM_REWARD_CASES))
def test_broken_custom_reward_file_is_one_line(capsys, tmp_path, base, case):
    """custom_reward_function is loaded in the validation pass: a broken file names itself, the
    line and the fix before any model loads."""
    body, *needles = CUSTOM_REWARD_CASES[case]
    (tmp_path / "r.py").write_text(body)
    fails(capsys, base + [f"custom_reward_function.path={tmp_path / 'r.py'}"], *needles)


def test_custom_reward_file_missing(capsys, tmp_path, base):
    fails(capsys, base + [f"custom_reward_function.path={tmp_path / 'no.py'}"], "no such file")
    fails(capsys, base + [f"custom_reward_function.path={tmp_path}"], "is a directory")


def test_batch_custom_function_needs_list_parameters(capsys, tmp_path, base):
    (tmp_path / "r.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0\n"
    )
    argv = base + [f"custom_reward_function.path={tmp_path / 'r.py'}", "reward.reward_manager=batch"]
    fails(capsys, argv, "data_sources, solution_strs, ground_truths, extra_infos")


def test_custom_reward_function_scores_unregistered_data_sources(tmp_path, base):
    """With a custom function, a data_source without a registered function is fine (it scores all)."""
    from minirl.config.load import load_config
    from minirl.plugins import PluginManager
    from minirl.validate.core import find_problems

    (tmp_path / "r.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1\n"
    )
    path = write_rows(tmp_path / "d.parquet", [good_row(i, data_source="my_task") for i in range(4)])
    overrides = [a for a in base[4:]] + [files_override(path), f"custom_reward_function.path={tmp_path / 'r.py'}"]
    cfg = load_config(BENCH, overrides, profile="cpu")
    assert find_problems(cfg, PluginManager(cfg.plugins.modules)) == []
    cfg = load_config(BENCH, overrides[:-1], profile="cpu")
    assert "my_task" in find_problems(cfg, PluginManager(cfg.plugins.modules))[0].rule


# ---------------------------------------------------------------------------------------------
# model directories
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny preset saved as a Hugging Face directory, with the byte tokenizer."""
    from minirl.models.loading import random_model
    from minirl.models.presets import preset_config
    from minirl.models.tokenizers import byte_tokenizer

    out = tmp_path_factory.mktemp("tiny-hf")
    random_model(preset_config("tiny"), "cpu", __import__("torch").float32).save_pretrained(out)
    byte_tokenizer().save_pretrained(out)
    return out


def copy_model(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in skip:
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_model_path_missing(capsys, tmp_path, base):
    fails(capsys, base + [f"model.path={tmp_path / 'nope'}"], "model.path", "no such directory")


def test_model_path_is_a_file(capsys, tmp_path, base):
    f = tmp_path / "weights.bin"
    f.write_text("x")
    fails(capsys, base + [f"model.path={f}"], "model.path", "is a file")


def test_model_path_without_config(capsys, tmp_path, base, model_dir):
    d = copy_model(model_dir, tmp_path / "m", skip=("config.json",))
    fails(capsys, base + [f"model.path={d}"], "model.path", "no config.json")


def test_model_path_without_weights(capsys, tmp_path, base, model_dir):
    d = copy_model(model_dir, tmp_path / "m", skip=("model.safetensors",))
    fails(capsys, base + [f"model.path={d}"], "model.path", "no weights")


def test_model_path_without_tokenizer(capsys, tmp_path, base, model_dir):
    d = copy_model(model_dir, tmp_path / "m", skip=("tokenizer.json", "tokenizer_config.json"))
    fails(capsys, base + [f"model.path={d}"], "model.path", "no tokenizer files")


def test_corrupt_config_json(capsys, tmp_path, base, model_dir):
    d = copy_model(model_dir, tmp_path / "m")
    (d / "config.json").write_text('{"model_type": "qwen2",')
    fails(capsys, base + [f"model.path={d}"], "model.path", "config.json is not valid JSON")


def test_config_json_without_model_type(capsys, tmp_path, base, model_dir):
    d = copy_model(model_dir, tmp_path / "m")
    (d / "config.json").write_text("{}")
    fails(capsys, base + [f"model.path={d}"], "model.path", "no model_type")


def test_unknown_model_type(capsys, tmp_path, base, model_dir):
    d = copy_model(model_dir, tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "model_type": "qwen9"}))
    fails(capsys, base + [f"model.path={d}"], "model.path", "model_type 'qwen9'")


def test_truncated_safetensors(capsys, tmp_path, base, model_dir):
    d = copy_model(model_dir, tmp_path / "m")
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    fails(capsys, base + [f"model.path={d}"], "model.safetensors is truncated")


def test_weights_that_do_not_match_the_config(base, tmp_path, model_dir):
    """Shapes that disagree with config.json fail at load, named by directory, with the cause.
    (A subprocess: transformers prints its load report through a logging handler of its own.)"""
    d = copy_model(model_dir, tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    run = cli(*base, f"model.path={d}")
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    line = next(ln for ln in run.stderr.splitlines() if ln.startswith("minirl: error:"))
    assert f"model.path = '{d}'" in line and "mismatch" in line and "MINIRL_DEBUG=1" in line


def test_vocabulary_smaller_than_the_tokenizer(capsys, tmp_path, base):
    """A tokenizer with ids past the embedding table fails at load, not in the first forward."""
    from minirl.models.loading import random_model
    from minirl.models.presets import preset_config
    from minirl.models.tokenizers import byte_tokenizer

    config = preset_config("tiny")
    config.vocab_size, config.eos_token_id = 200, 199
    d = tmp_path / "small-vocab"
    random_model(config, "cpu", __import__("torch").float32).save_pretrained(d)
    byte_tokenizer().save_pretrained(d)
    fails(capsys, base + [f"model.path={d}"], "the tokenizer has 259 tokens", "200")


def test_tokenizer_directory_missing(capsys, tmp_path, base):
    fails(capsys, base + [f"model.tokenizer={tmp_path / 'tok'}"], "model.tokenizer", "is not a directory")


def test_tokenizer_directory_without_files(capsys, tmp_path, base):
    fails(capsys, base + [f"model.tokenizer={tmp_path}"], "model.tokenizer", "no tokenizer files")


def test_attn_implementation_unknown(capsys, base):
    fails(capsys, base + ["model.attn_implementation=flash9"], "model.attn_implementation = 'flash9'")


# ---------------------------------------------------------------------------------------------
# plugins
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """Write a throw-away plugin module on sys.path; returns its name."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names = []

    def write(name: str, body: str) -> str:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
        names.append(name)
        return name

    yield write
    for name in names:
        sys.modules.pop(name, None)


PLUGIN_CASES = {
    "syntax_error": ("def oops(:\n", "importing plugin module", "SyntaxError"),
    "raises_at_import": ("raise RuntimeError('no licence key')\n", "RuntimeError: no licence key"),
    "imports_missing_package": ("import not_a_package_xyz\n", "not_a_package_xyz"),
    "hook_name_typo": (
        "from minirl import hookimpl\n@hookimpl\ndef minirl_advantage_estimator():\n    return {}\n",
        "'minirl_advantage_estimator'",
        "did you mean 'minirl_advantage_estimators'",
    ),
    "hook_argument_typo": (
        "from minirl import hookimpl\n@hookimpl\ndef minirl_on_step_end(step, metrix):\n    pass\n",
        "metrix",
    ),
    "hook_raises": (
        "from minirl import hookimpl\n@hookimpl\ndef minirl_loggers():\n    raise KeyError('cfg')\n",
        "minirl_loggers()",
        "KeyError",
    ),
    "answer_not_a_dict": (
        "from minirl import hookimpl\n@hookimpl\ndef minirl_loggers():\n    return ['console']\n",
        "must return a dict",
    ),
    "duplicate_name": (
        "from minirl import hookimpl\n@hookimpl\ndef minirl_advantage_estimators():\n    return {'grpo': len}\n",
        "'grpo' is registered twice",
    ),
}


@pytest.mark.parametrize("case", sorted(PLUGIN_CASES))
def test_broken_plugin_module_is_named(capsys, base, plugin_dir, case):
    """A plugin that does not import or register names itself and the original message."""
    body, *needles = PLUGIN_CASES[case]
    name = plugin_dir(f"tmp_plugin_{case}", body)
    fails(capsys, base + [f'plugins.modules=["{name}"]'], name, *needles)


def test_plugin_module_missing(capsys, base):
    fails(capsys, base + ['plugins.modules=["tmp_plugin_absent"]'], "'tmp_plugin_absent'", "no such module")


def test_plugin_error_under_debug_keeps_the_traceback(base, tmp_path):
    """MINIRL_DEBUG=1 lets a plugin author see the full traceback of their own error."""
    (tmp_path / "tmp_plugin_debug.py").write_text("raise RuntimeError('boom')\n")
    env = {**os.environ, "MINIRL_DEBUG": "1", "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    run = cli(*base, 'plugins.modules=["tmp_plugin_debug"]', env=env)
    assert run.returncode == 1 and "Traceback" in run.stderr and "RuntimeError: boom" in run.stderr


ESTIMATOR = """
import torch
from minirl import hookimpl

def broken(inputs, cfg):
    {body}

@hookimpl
def minirl_advantage_estimators():
    return {{"broken": broken}}
"""


def test_estimator_that_raises_is_named(capsys, base, plugin_dir):
    name = plugin_dir("tmp_plugin_est_raise", ESTIMATOR.format(body="raise IndexError('group 7')"))
    argv = base + [f'plugins.modules=["{name}"]', "algorithm.adv_estimator=broken"]
    fails(capsys, argv, "advantage estimator 'broken'", "IndexError: group 7", name)


def test_estimator_with_the_wrong_shape_is_named(capsys, base, plugin_dir):
    body = "adv = inputs.token_rewards_BT.sum(-1)\n    return adv, adv"
    name = plugin_dir("tmp_plugin_est_shape", ESTIMATOR.format(body=body))
    argv = base + [f'plugins.modules=["{name}"]', "algorithm.adv_estimator=broken"]
    fails(capsys, argv, "advantage estimator 'broken'", "expected [B, T]")


# ---------------------------------------------------------------------------------------------
# the command line as a process
# ---------------------------------------------------------------------------------------------


def cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "minirl", *args], capture_output=True, text=True, cwd=ROOT, timeout=120, **kwargs
    )


def test_print_config_writes_valid_toml_to_stdout(tmp_path):
    """The profile notice goes to stderr, so `--print-config > job.toml` is valid TOML."""
    import tomllib

    run = cli("--config", BENCH, "--print-config")
    assert run.returncode == 0, run.stderr
    assert "using profile" in run.stderr and "using profile" not in run.stdout
    assert tomllib.loads(run.stdout)["model"]["preset"] == "tiny"


def test_plugins_command_reads_the_config_and_is_in_help(tmp_path):
    """`python -m minirl plugins --config X` lists the config's own plugin modules."""
    (tmp_path / "tmp_plugin_listed.py").write_text(
        "from minirl import hookimpl\n@hookimpl\ndef minirl_policy_losses():\n    return {'mine': len}\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    run = cli("plugins", "--config", BENCH, 'plugins.modules=["tmp_plugin_listed"]', env=env)
    assert run.returncode == 0, run.stderr
    assert "tmp_plugin_listed" in run.stdout and "mine" in run.stdout
    assert "plugins" in cli("--help").stdout.split("options:")[0]


def test_ctrl_c_during_start_up_is_one_line_and_130(tmp_path):
    """Ctrl-C while the job starts: no KeyboardInterrupt traceback, exit status 130. A plugin
    that is slow to import holds start-up still while the signal arrives."""
    marker = tmp_path / "importing"
    (tmp_path / "tmp_plugin_slow.py").write_text(
        f"import pathlib, time\npathlib.Path({str(marker)!r}).touch()\ntime.sleep(60)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "minirl", "--config", BENCH, "--profile", "cpu", 'plugins.modules=["tmp_plugin_slow"]'],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # a shell that starts jobs in the background (CI) hands them SIGINT ignored, and Python
        # then keeps ignoring it; a terminal's Ctrl-C reaches a process with the default action
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted" in err


# ---------------------------------------------------------------------------------------------
# non-finite numbers
# ---------------------------------------------------------------------------------------------


def test_nan_advantages_from_a_plugin_stop_the_run(capsys, base, plugin_dir):
    """An estimator returning NaN never reaches the weights, and the run does not "succeed":
    after trainer.max_nonfinite_steps bad steps in a row it stops, naming the phase."""
    body = "adv = torch.full_like(inputs.token_rewards_BT, float('nan'))\n    return adv, adv"
    name = plugin_dir("tmp_plugin_est_nan", ESTIMATOR.format(body=body))
    argv = base + [
        f'plugins.modules=["{name}"]',
        "algorithm.adv_estimator=broken",
        "trainer.total_training_steps=4",
        "trainer.max_nonfinite_steps=2",
    ]
    fails(capsys, argv, "step 2: 2 steps in a row", "'adv'", "trainer.max_nonfinite_steps")


def test_tool_file_entry_errors_name_the_entry(capsys, tmp_path, base):
    """A tool file whose entry names no registered tool: one line, the entry and the closest name."""
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n  - class_name: calculatr\n    config: {type: native}\n")
    argv = base + ["rollout.multi_turn.enable=true", f"rollout.multi_turn.tool_config_path={path}"]
    fails(capsys, argv, "tools.yaml", "calculatr", "calculator")


def test_tool_file_missing_or_malformed_says_so_once(capsys, tmp_path, base):
    """A missing tool file: the key once, "no such file" and how to make one (not "fix the file");
    a malformed one: the line and column where YAML stopped, "fix the file" once."""
    argv = base + ["rollout.multi_turn.enable=true", f"rollout.multi_turn.tool_config_path={tmp_path}/t.yaml"]
    message = fails(capsys, argv, "no such file", "examples/tools/tool_config.yaml")
    assert message.count("tool_config_path") == 1 and "fix the file" not in message
    (tmp_path / "t.yaml").write_text("tools:\n  - class_name: calculator\n    config: {type: native\n")
    message = fails(capsys, argv, "not valid YAML at line 4, column 1", "fix the file")
    assert message.count("tool_config_path") == 1 and message.count("fix the file") == 1


def test_unknown_data_source_names_both_ways_to_score_it(capsys, tmp_path, base):
    """An unknown data_source: a plugin hook or, without writing a plugin, custom_reward_function.path."""
    path = write_rows(tmp_path / "d.parquet", [good_row(i, data_source="my_task") for i in range(50)])
    fails(capsys, base + [files_override(path)], "custom_reward_function.path", "minirl_reward_functions hook")


def test_agent_name_not_a_string_names_the_row(capsys, tmp_path, base):
    path = write_rows(tmp_path / "d.parquet", [good_row(i, agent_name=7) for i in range(8)])
    fails(capsys, base + [files_override(path)], "d.parquet:0", "field 'agent_name' must be a string")


def test_unknown_agent_name_in_a_row_names_the_row(capsys, tmp_path, base):
    path = write_rows(tmp_path / "d.parquet", [good_row(i, agent_name="tool_agnt") for i in range(8)])
    fails(capsys, base + [files_override(path)], "d.parquet:0", "agent_name = 'tool_agnt'", "tool_agent")


# ---------------------------------------------------------------------------------------------
# LoRA adapter directories (model.lora_adapter_path)
# ---------------------------------------------------------------------------------------------


def _adapter(tmp_path: Path, preset: str, *overrides: str) -> Path:
    """A peft adapter directory minirl wrote for `preset` (fresh adapters)."""
    import torch

    from minirl.config.load import load_config
    from minirl.models import lora
    from minirl.models.loading import random_model
    from minirl.models.presets import preset_config

    cfg = load_config(None, ["model.lora_rank=4", *overrides]).model
    model = lora.apply_lora(random_model(preset_config(preset), "cpu", torch.float32), cfg, preset)
    lora.save_adapter(model, str(tmp_path / "adapter"))
    return tmp_path / "adapter"


def test_lora_adapter_of_another_base_model(capsys, tmp_path, base):
    """adapter_config.json names its base (a preset here); another model.preset is refused."""
    path = _adapter(tmp_path, "tiny")
    fails(capsys, base + [f"model.lora_adapter_path={path}", "model.preset=qwen3-tiny"], "trained on 'tiny'")


def test_lora_adapter_whose_shapes_do_not_fit(capsys, tmp_path, base):
    """An adapter that does not name its base: the tensor shapes decide, and qwen3-tiny's q_proj
    has 128 outputs where tiny's has 64."""
    path = _adapter(tmp_path, "qwen3-tiny")
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": None}))
    fails(capsys, base + [f"model.lora_adapter_path={path}"], "model.lora_adapter_path", "another base model")


def test_lora_adapter_directory_without_weights(capsys, tmp_path, base):
    path = _adapter(tmp_path, "tiny")
    (path / "adapter_model.safetensors").unlink()
    fails(capsys, base + [f"model.lora_adapter_path={path}"], "has no adapter_model.safetensors")
