"""The core configuration sections: one frozen dataclass per section, with verl's key names.

A key means what it means in verl wherever verl has it. Plugins add their own sections through
the `minirl_config_sections` hook. `minirl.config.load` parses TOML into these classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union


@dataclass(frozen=True)
class ModelConfig:
    path: str = ""  # a local Hugging Face directory; empty = use `preset`
    preset: str = "tiny"  # tiny | qwen2-1.5b | ... (random weights, no network)
    tokenizer: str = ""  # a local tokenizer directory; empty = the model's, or the preset's
    dtype: str = "float32"  # parameter dtype of the actor: float32 | bfloat16
    enable_gradient_checkpointing: bool = False
    # with checkpointing: the first N decoder layers recompute their activations in the backward,
    # the others keep them (-1: every layer; Megatron's recompute_num_layers, block method)
    recompute_num_layers: int = -1
    attn_implementation: str = "minirl"  # minirl (packed varlen) | sdpa | eager
    compile_layers: bool = False  # torch.compile each decoder layer (actor and reference): fuses the element-wise work
    # with compile_layers on one CUDA process: a second process compiles the layers' graphs into
    # inductor's cache while this one builds its engine and generates; step 1 loads them (minirl/precompile.py)
    precompile: bool = True
    # how long the first compiled pass waits for a twin still compiling, before it stops the twin and
    # compiles what the cache lacks itself (0: never waits; what the twin finished is used either way)
    precompile_wait_s: float = 0.0
    fused_mlp: bool = False  # SiLU·mul in the gate/up GEMM's epilogue in gradient-free forwards (Hopper GPUs)
    seed: int = 0  # seed of the random weights of a preset (and of fresh LoRA adapters)
    # LoRA (minirl[lora], peft; docs/architecture.md): train low-rank adapters, the base weights frozen
    lora_rank: int = 0  # 0: off (full fine-tuning); r of the adapters
    lora_alpha: int = 16  # the adapters' output is scaled by lora_alpha / lora_rank
    target_modules: Union[str, list[str]] = "all-linear"  # all-linear, a list of module names, or a regex
    exclude_modules: Union[str, list[str]] = field(default_factory=list)  # names (list) or a regex (string)
    lora_dropout: float = 0.0  # dropout on the adapters' input in training forwards
    lora_adapter_path: str = ""  # a peft adapter directory to continue from (enables LoRA)
    lora_save_merged: bool = False  # save_hf_freq also writes the merged full weights (hf_step_N/merged)


@dataclass(frozen=True)
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    max_prompt_length: int = 512
    max_response_length: int = 512
    train_batch_size: int = 8  # prompts per step
    filter_overlong_prompts: bool = True
    truncation: str = "error"  # error | left | right | middle
    shuffle: bool = True
    seed: int = 1


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    lr_warmup_steps: int = -1  # -1: use lr_warmup_steps_ratio
    lr_warmup_steps_ratio: float = 0.0
    warmup_style: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.0


@dataclass(frozen=True)
class FSDPConfig:
    param_offload: bool = False
    optimizer_offload: bool = False
    reshard_after_forward: bool = True
    param_dtype: str = "auto"  # compute dtype of the sharded model; auto: bfloat16 on CUDA, else model.dtype
    reduce_dtype: str = "float32"  # dtype of the gradient reduce-scatter


@dataclass(frozen=True)
class ActorConfig:
    ppo_mini_batch_size: int = 8  # prompts per mini-batch (times rollout.n sequences)
    ppo_micro_batch_size_per_gpu: int = 4  # sequences per micro-batch (without dynamic bsz)
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384  # token budget per micro-batch with dynamic bsz
    ppo_epochs: int = 1
    shuffle: bool = False
    policy_loss: str = "vanilla"  # vanilla (PPO clip) | gspo (sequence-level ratio; docs/plugins.md)
    clip_ratio: float = 0.2  # vanilla: the clip range where _low / _high are unset (gspo ignores it)
    clip_ratio_low: Optional[float] = None  # unset: clip_ratio (vanilla), 3e-4 (gspo)
    clip_ratio_high: Optional[float] = None  # unset: clip_ratio (vanilla), 4e-4 (gspo)
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: Optional[float] = None
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    grad_clip: float = 1.0
    # truncated importance sampling: policy loss per token x min(exp(lp_old - lp_rollout), cap); -1: off
    tis_imp_ratio_cap: float = -1.0
    ulysses_sequence_parallel_size: int = 1
    # one mini-batch and one epoch: the old log-probs are the update forward's own, detached, so
    # the separate prev-log-prob pass is skipped (minirl.update.actor.on_policy); false forces the pass
    on_policy_shortcut: bool = True
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass(frozen=True)
class MultiTurnConfig:
    """Multi-turn rollouts with tools (verl's rollout.multi_turn names; docs/agents.md)."""

    enable: bool = False  # false: every row runs rollout.agent.default_agent_loop's single turn
    max_assistant_turns: Optional[int] = None  # stop after this many model turns (None: the budget decides)
    max_user_turns: Optional[int] = None  # stop after this many tool/user messages
    # most tokens one model turn may generate (None: what is left of data.max_response_length); a
    # turn cut by it ends the trajectory, as one cut by the budget does
    max_tokens_per_turn: Optional[int] = None
    max_parallel_calls: int = 1  # tool calls run per turn (concurrently); the rest get an error message
    max_tool_response_length: int = 256  # characters of one tool result the model sees
    tool_response_truncate_side: str = "middle"  # left: keep the tail, right: keep the head, middle: both ends
    tool_config_path: str = ""  # YAML or JSON file in verl's shape: tools: [{class_name, config, tool_schema}]
    format: str = "hermes"  # tool-call format: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    # true: a rollout's tokens do not depend on when its tool calls finish (same seed, same tokens,
    # run after run), at a price: the engine waits for every running tool call before its next step
    deterministic: bool = False


@dataclass(frozen=True)
class AgentConfig:
    default_agent_loop: str = "single_turn"  # for rows without an agent_name column (single_turn | tool_agent | plugin)


@dataclass(frozen=True)
class RolloutConfig:
    name: str = "native"  # native | hf | sglang
    n: int = 4
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    do_sample: bool = True
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    kv_cache_dtype: str = "auto"  # auto: rollout.dtype; fp8 (= fp8_e4m3), fp8_e5m2: half the KV bytes (native, sglang)
    # fp8: the layers' GEMMs on e4m3 weights and activations, one dynamic scale each (native, sglang);
    # the embedding and lm_head stay in rollout.dtype. Turns TIS on, as an fp8 KV cache does
    quantization: str = "none"
    # share of free device memory for the KV cache; the native engine's takes no more than a step's
    # prompts x n rows can fill at max_prompt_length + max_response_length
    gpu_memory_utilization: float = 0.5
    max_num_seqs: int = 1024  # most sequences decoding at once
    enforce_eager: bool = False  # true: no CUDA graphs
    free_cache_engine: bool = True  # release the KV cache outside generation
    ignore_eos: bool = False  # benchmarks only: always generate max_response_length tokens
    log_prob_micro_batch_size_per_gpu: int = 8
    log_prob_use_dynamic_bsz: bool = False
    log_prob_max_token_len_per_gpu: int = 16384
    calculate_log_probs: bool = True  # keep the engine's sampled-token log-probs (rollout_log_probs, rollout_corr/*)
    update_weights_bucket_megabytes: int = 512  # weight-sync bucket size: sglang, and the async link
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    # asynchronous training (async_training.enable): the rollout ranks, apart from the trainer's
    nnodes: int = 1
    n_gpus_per_node: int = 0  # rollout ranks per node (on CPU: rollout processes among trainer.world_size)


@dataclass(frozen=True)
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int = 8
    log_prob_use_dynamic_bsz: bool = False
    log_prob_max_token_len_per_gpu: int = 16384
    offload: bool = False  # keep the reference on the CPU between phases
    ulysses_sequence_parallel_size: int = 1
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass(frozen=True)
class CriticModelConfig:
    path: str = ""  # the value model's backbone: a local Hugging Face directory; empty = the actor's model
    enable_gradient_checkpointing: bool = False
    recompute_num_layers: int = -1  # the first N layers recompute (model.recompute_num_layers)
    compile_layers: bool = False  # torch.compile each of the critic's decoder layers (model.compile_layers)
    fused_mlp: bool = False  # the critic's values passes with model.fused_mlp's kernel


@dataclass(frozen=True)
class CriticConfig:
    """The value model of PPO with GAE (built only when algorithm.adv_estimator needs values).
    A key left unset takes the actor's value, as in verl (minirl.critic.resolved)."""

    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))  # verl's critic lr
    ppo_mini_batch_size: Optional[int] = None  # prompts per critic mini-batch (x rollout.n)
    ppo_micro_batch_size_per_gpu: Optional[int] = None  # sequences per micro-batch of the update
    use_dynamic_bsz: Optional[bool] = None
    ppo_max_token_len_per_gpu: Optional[int] = None  # token budget per micro-batch with dynamic bsz
    # the values pass (forward only) may take bigger micro-batches; unset: the ppo_ keys above
    forward_micro_batch_size_per_gpu: Optional[int] = None
    forward_max_token_len_per_gpu: Optional[int] = None
    ppo_epochs: Optional[int] = None
    shuffle: Optional[bool] = None
    cliprange_value: float = 0.5  # new values stay within old ± this in the clipped branch
    loss_agg_mode: Optional[str] = None
    grad_clip: float = 1.0
    ulysses_sequence_parallel_size: int = 1  # runs on the actor's mesh: 1 or the actor's
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass(frozen=True)
class KLCtrlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass(frozen=True)
class FilterGroupsConfig:
    """DAPO's dynamic sampling (minirl.rollout.dynamic_sampling)."""

    enable: bool = False  # drop groups whose metric is the same for all n samples; refill from more prompts
    metric: str = "score"  # score | seq_reward | seq_final_reward (minirl.algo.dynamic_sampling.SEQUENCE_METRICS)
    max_num_gen_batches: int = 0  # most generation batches per step (then a short step); <= 0: no cap


@dataclass(frozen=True)
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)


@dataclass(frozen=True)
class TrainerConfig:
    project_name: str = "minirl"
    experiment_name: str = "run"
    total_epochs: int = 1
    total_training_steps: int = 0  # 0: derived from epochs and data size
    n_gpus_per_node: int = 1
    nnodes: int = 1
    world_size: int = 1  # CPU processes in all (tests); on GPU the world is nnodes * n_gpus_per_node
    launcher: str = "auto"  # auto | local | torchrun | ray (or a plugin's); docs/multinode.md
    ray_address: str = ""  # the Ray cluster (HEAD_IP:6379, or "auto"); "": RAY_ADDRESS if set
    ray_placement_timeout_s: int = 120  # the ray launcher's wait for the cluster's GPUs/CPUs
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 1
    default_local_dir: str = "runs"  # run directories go under it
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    progress_bar: bool = True
    test_freq: int = -1  # validate every N steps and after the last one (-1: never)
    save_freq: int = -1  # write a full, resumable checkpoint every N steps and after the last (-1: never)
    save_hf_freq: int = -1  # export the actor as a Hugging Face directory every N steps and after the last
    max_ckpt_to_keep: int = 0  # keep the newest N complete checkpoints (0: all)
    # training continues once the checkpoint's state is copied to host memory; the write runs in
    # the background (costs host memory equal to the rank's share of the checkpoint)
    async_save: bool = True
    resume_mode: str = "auto"  # auto (newest complete checkpoint, else fresh) | disable | resume_path
    resume_from_path: str = ""  # the checkpoint directory resume_mode = "resume_path" loads
    resume_ignore_config_changes: bool = False  # resume even if keys that change the math differ
    val_before_train: bool = False
    collective_timeout_s: int = 300
    peak_flops: float = 0.0  # per-GPU dense bf16 FLOP/s for MFU; 0: from the device name
    max_nonfinite_steps: int = 3  # stop after this many consecutive steps with a non-finite loss or gradient
    critic_warmup: int = 0  # the first N steps update only the critic (the actor update is skipped)


@dataclass(frozen=True)
class OverlongBufferConfig:
    """DAPO's soft overlong punishment (minirl.reward.overlong)."""

    enable: bool = False
    len: int = 0  # the last `len` tokens before data.max_response_length are penalised linearly
    penalty_factor: float = 1.0  # the penalty at data.max_response_length (as -penalty_factor)


@dataclass(frozen=True)
class RewardConfig:
    reward_manager: str = "naive"  # naive: one call per response | batch: one call for many (needs a custom function)
    num_workers: int = 0  # worker processes for the reward calls; 0: in the training process
    timeout_s: float = 60.0  # per call, at any num_workers: a call past it scores 0 (reward/timeouts)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)


@dataclass(frozen=True)
class CustomRewardFunctionConfig:
    path: str = ""  # a Python file; its function scores every data_source (empty: the registry)
    name: str = "compute_score"  # the function in it: (data_source, solution_str, ground_truth, extra_info=None)


@dataclass(frozen=True)
class PluginsConfig:
    modules: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class AsyncTrainingConfig:
    """Asynchronous off-policy training on separate rollout and trainer ranks (verl's names;
    docs/async.md). Off by default: the collocated synchronous loop."""

    enable: bool = False
    # versions a sample may lag behind the trainer when it is trained on (its oldest token's);
    # older ones are dropped and counted. 0: on-policy (the rollout waits for every update),
    # 1: one-step off-policy. (verl's fully-async reads this key as a fraction of extra samples.)
    staleness_threshold: int = 1
    trigger_parameter_sync_step: int = 1  # trainer steps between weight syncs to the rollout ranks
    require_batches: int = 1  # ppo mini-batches a trainer step takes (= data.train_batch_size / ppo_mini_batch_size)
    partial_rollout: bool = True  # on a sync, in-flight requests continue with the new weights (KV kept)
    use_rollout_log_probs: bool = True  # the behaviour policy's log-probs are the old log-probs (bypass)
    compute_prox_log_prob: bool = False  # decoupled PPO: old = the trainer's recomputed (proximal) log-probs


CORE_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "actor": ActorConfig,
    "rollout": RolloutConfig,
    "ref": RefConfig,
    "critic": CriticConfig,
    "algorithm": AlgorithmConfig,
    "trainer": TrainerConfig,
    "reward": RewardConfig,
    "custom_reward_function": CustomRewardFunctionConfig,
    "plugins": PluginsConfig,
    "async_training": AsyncTrainingConfig,
}
