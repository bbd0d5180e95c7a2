"""Hook specifications: the contracts between minirl's core and its plugins, grouped by phase:
registration (start-up), assembly (turning a plain model into the actor, the reference and the
critic) and events (phase boundaries, never per token). Hooks only build objects; the training
loop calls the components directly (their shapes: minirl.protocols).
"""

from __future__ import annotations

from typing import Any

import pluggy
import torch

from minirl.protocols import (
    AdvantageEstimator,
    AgentLoopFactory,
    EngineFactory,
    KLEstimator,
    Launcher,
    LoggerFactory,
    PolicyLoss,
    RewardFunction,
    ToolFactory,
)

hookspec = pluggy.HookspecMarker("minirl")
hookimpl = pluggy.HookimplMarker("minirl")

# ---------------------------------------------------------------------------------------------
# registration hooks: called once at start-up; the answers of every plugin are merged into one
# registry per kind, and a name given twice is an error naming both plugins
# ---------------------------------------------------------------------------------------------


@hookspec
def minirl_advantage_estimators() -> dict[str, AdvantageEstimator]:
    """Register advantage estimators, selected by ``algorithm.adv_estimator``.

    Called once at start-up; every answer is merged.
    :return: name -> estimator.
    Built-in: ``minirl_plugins.algorithms.advantage`` (grpo, rloo, reinforce_plus_plus,
    reinforce_plus_plus_baseline, opo, gae).
    """


@hookspec
def minirl_kl_estimators() -> dict[str, KLEstimator]:
    """Register KL estimators, selected by ``actor.kl_loss_type`` and ``algorithm.kl_penalty``.

    Called once at start-up; every answer is merged.
    :return: name -> estimator.
    Built-in: ``minirl_plugins.algorithms.kl`` (k1/kl, abs, k2/mse, k3/low_var_kl, the ``+`` variants, full).
    """


@hookspec
def minirl_policy_losses() -> dict[str, PolicyLoss]:
    """Register policy losses, selected by ``actor.policy_loss``.

    Called once at start-up; every answer is merged.
    :return: name -> loss.
    Built-in: ``minirl_plugins.algorithms.policy_loss`` (vanilla: PPO clip with dual clip).
    """


@hookspec
def minirl_reward_functions() -> dict[str, RewardFunction]:
    """Register rule reward functions, selected by each parquet row's ``data_source`` (unless
    ``custom_reward_function.path`` names one function for every data_source).

    Called once at start-up, and again in each reward worker (``reward.num_workers > 0``) from
    the same plugin modules, so the functions need not pickle; every answer is merged.
    :return: data_source -> reward function.
    Built-in: ``minirl_plugins.rewards`` (gsm8k, openai/gsm8k, math, lighteval/MATH,
    DigitalLearningGmbH/MATH-lighteval, countdown, copy).
    """


@hookspec
def minirl_rollout_engines() -> dict[str, EngineFactory]:
    """Register rollout engines, selected by ``rollout.name``.

    Called once at start-up; every answer is merged.
    :return: name -> factory(rollout_cfg, ctx).
    Built-in: ``minirl_plugins.engines.native`` (native), ``minirl_plugins.engines.hf`` (hf).
    """


@hookspec
def minirl_agent_loops() -> dict[str, AgentLoopFactory]:
    """Register agent loops, selected per row by the parquet column ``agent_name``, else by
    ``rollout.agent.default_agent_loop``.

    Called once at start-up; every answer is merged.
    :return: name -> factory(rollout_cfg).
    Built-in: ``minirl_plugins.agents`` (single_turn, tool_agent).
    """


@hookspec
def minirl_tools() -> dict[str, ToolFactory]:
    """Register tools, named by the ``class_name`` of an entry of the tool config file
    (``rollout.multi_turn.tool_config_path``; a dotted path there imports a class instead).

    Called once at start-up; every answer is merged.
    :return: name -> factory(config).
    Built-in: ``minirl_plugins.tools`` (calculator, python).
    """


@hookspec
def minirl_loggers() -> dict[str, LoggerFactory]:
    """Register metric loggers, selected by ``trainer.logger`` (a list).

    Called once at start-up; every answer is merged.
    :return: name -> factory(trainer_cfg, run_dir).
    Built-in: ``minirl_plugins.observe.loggers`` (console, jsonl, tensorboard, wandb).
    """


@hookspec
def minirl_config_sections() -> dict[str, type]:
    """Register a plugin's own configuration sections.

    Called once, before the config file is read; every answer is merged.
    :return: section name -> frozen dataclass type with defaults for every field.
    Built-in: none (the core sections are fixed).
    """


@hookspec
def minirl_launchers() -> dict[str, Launcher]:
    """Register launchers (how the ranks of a job are started), selected by ``trainer.launcher``
    (``auto``: torchrun under torchrun, ray for ``trainer.nnodes > 1`` or a Ray address, else local).

    Called once at start-up; every answer is merged.
    :return: name -> launcher(cfg, pm, job) -> exit status; it ends in
        ``minirl.dist.spmd.init_from_env`` on every rank.
    Built-in: ``minirl_plugins.launchers`` (local, torchrun), ``minirl_plugins.launchers.ray`` (ray).
    """


# ---------------------------------------------------------------------------------------------
# assembly hooks (called in this order by minirl.models.assembly)
# ---------------------------------------------------------------------------------------------


@hookspec
def minirl_apply_sequence_parallel(model: torch.nn.Module, cfg: Any, mesh: Any) -> None:
    """Make the model's attention sequence-parallel, in place.

    Called first, for the actor, the reference and the critic; every implementation runs.
    :param model: the plain transformers model.
    :param cfg: the ``actor`` (or ``ref``, ``critic``) config section.
    :param mesh: the device mesh (dims ``dp``, ``sp``), or None on one CPU process.
    Built-in: ``minirl_plugins.parallel.ulysses`` (acts when ulysses_sequence_parallel_size > 1).
    """


@hookspec
def minirl_apply_activation_checkpointing(model: torch.nn.Module, cfg: Any) -> None:
    """Wrap decoder layers with activation checkpointing, in place.

    Called second, for the actor and the critic; every implementation runs.
    :param cfg: the ``model`` (or ``critic.model``) config section (enable_gradient_checkpointing).
    Built-in: ``minirl_plugins.parallel.checkpointing``.
    """


@hookspec(firstresult=True)
def minirl_apply_data_parallel(model: torch.nn.Module, cfg: Any, mesh: Any) -> torch.nn.Module | None:
    """Shard or replicate the model over the data-parallel ranks.

    Called third, for the actor, the reference and the critic; the first non-None answer wins.
    :param cfg: the ``actor`` (or ``ref``, ``critic``) config section.
    :param mesh: the device mesh, or None on one CPU process.
    :return: the wrapped module, or None to leave it to another plugin.
    Built-in: ``minirl_plugins.parallel.fsdp2`` (acts whenever there is a mesh: on CUDA, one GPU too).
    """


@hookspec(firstresult=True)
def minirl_build_optimizer(model: torch.nn.Module, cfg: Any, total_steps: int) -> Any:
    """Build the optimizer and learning-rate schedule of the actor (and of the critic).

    Called last, for the actor and the critic; the first non-None answer wins.
    :param cfg: the ``actor.optim`` (or ``critic.optim``) config section.
    :param total_steps: training steps of the whole run (for warm-up ratios and decay); the
        trainer steps the schedule once per training step, whatever its number of optimizer steps.
    :return: (optimizer, lr_scheduler).
    Built-in: ``minirl_plugins.algorithms.optim`` (AdamW with warm-up and constant/cosine decay).
    """


# ---------------------------------------------------------------------------------------------
# event hooks
# ---------------------------------------------------------------------------------------------


@hookspec
def minirl_on_step_end(step: int, metrics: dict[str, float]) -> None:
    """Observe a finished training step.

    Called on every rank once the step's metrics are final; every implementation runs.
    :param step: the 1-based step number.
    :param metrics: the step's metrics (already reduced over ranks).
    """


@hookspec
def minirl_on_checkpoint_saved(step: int, path: str) -> None:
    """Observe a saved checkpoint.

    Called on rank 0 after a checkpoint directory is complete; every implementation runs.
    :param step: the step the checkpoint holds.
    :param path: its directory.
    """
