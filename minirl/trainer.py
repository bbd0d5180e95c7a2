"""The training loop: one step for every mode. What differs is chosen once, when the trainer is
built: the batch source and the weight sync (collocated, or an asynchronous job's rollout ranks:
minirl.rollout.source) and the model adapter (full fine-tuning or LoRA: minirl.adapter).

The same code runs on one process and on every rank of an SPMD job: each rank takes whole
prompt groups, and every batch-wide statistic goes through DistContext.all_reduce.
"""

from __future__ import annotations

import os
import signal

import torch
from tqdm import tqdm

from minirl import build, precompile
from minirl.algo.guard import NonFiniteGuard
from minirl.algo.kl_control import apply_kl_in_reward, build_kl_controller
from minirl.batch import RolloutBatch
from minirl.checkpoint import state as ckpt_state
from minirl.checkpoint import training as ckpt_training
from minirl.checkpoint.resume import plan_run
from minirl.checkpoint.training import TrainingState
from minirl.config.load import Config
from minirl.critic import critic_line
from minirl.critic import update as critic_lib
from minirl.data.identity import file_identity
from minirl.dist import spmd
from minirl.dist.context import DistContext
from minirl.dist.signals import StopRequest
from minirl.errors import Stopped, describe
from minirl.forward.packed import logprob_head, per_token_pass
from minirl.models import assembly
from minirl.observe.memory import held_memory, memory_line
from minirl.observe.metrics import PhaseTimer, summary_table
from minirl.observe.runs.read import logged_val_scores
from minirl.observe.runs.status import RunStatus
from minirl.observe.step_metrics import agent_metrics, data_metrics, perf_metrics, value_metrics
from minirl.protocols import AdvantageInputs
from minirl.rollout.collocated import collocated
from minirl.rollout.source import Parts, Rollouts
from minirl.update import actor as actor_lib


class Trainer:
    """Builds every component from the config (minirl.build), then runs `fit()`. `rollouts` makes
    the batch source and the weight sync (minirl.async_training.remote for an asynchronous job)."""

    def __init__(self, cfg: Config, pm, dist: DistContext, rollouts: Rollouts = collocated):
        self.cfg, self.pm, self.dist = cfg, pm, dist
        self.precompile = precompile.start(cfg, dist)  # model.precompile: the layers compile ahead, elsewhere
        torch.manual_seed(cfg.trainer.seed + dist.dp_rank)  # sp ranks share a batch: same draws
        self.tokenizer, self.adapter = build.models(pm, cfg, dist)  # full fine-tuning or LoRA
        self.actor = self.adapter.actor
        self.agents = build.agent_rollout(pm, cfg, self.tokenizer)  # before the data: prompts show the tools
        self.loader = build.train_loader(cfg.data, self.tokenizer, dist, self.agents.tool_schemas)
        self.agents.check_rows(self.loader.records)
        self.total_steps = build.total_steps(cfg.trainer, self.loader.steps_per_epoch)
        self.optimizer, self.scheduler = assembly.build_optimizer(pm, self.actor, cfg.actor.optim, self.total_steps)
        self.estimator = pm["advantage_estimators"].get(cfg.algorithm.adv_estimator)
        # before the engine, whose KV cache takes a share of the memory left free (None: no gae)
        self.critic = build.critic(pm, cfg, dist, self.total_steps, self.estimator, self._print)
        parts = Parts(pm, cfg, dist, self.adapter, self.tokenizer, self.agents, self.loader)
        self.source, self.sync = rollouts(parts)
        self.precompile.go()  # the engine has sized its KV cache: the twin may take device memory
        if cfg.custom_reward_function.path:
            crf = cfg.custom_reward_function
            self._print(f"reward: {crf.name}() from {crf.path} (custom_reward_function) scores every data_source")
        # the old log-probs come from the update's own forward (minirl.update.actor.on_policy)
        on_policy = actor_lib.on_policy(cfg.actor, cfg.data.train_batch_size, cfg.algorithm.use_kl_in_reward)
        self.on_policy = self.source.sampled_by_current_weights and on_policy
        losses = build.losses(pm, cfg.actor, self.adapter.reference)
        self.actor_update = build.actor_update(cfg, self.actor, self.optimizer, losses, dist, self.on_policy)
        self.old_micro, self.ref_micro = build.log_prob_micro(cfg.rollout), build.log_prob_micro(cfg.ref)
        self.kl_ctrl = build_kl_controller(cfg.algorithm.kl_ctrl) if cfg.algorithm.use_kl_in_reward else None
        self.guard = NonFiniteGuard(cfg.trainer.max_nonfinite_steps, verbose=dist.is_main)
        self.history: list[dict[str, float]] = []
        self.state = self._training_state()
        self.checkpoints = ckpt_training.writer(cfg.trainer, dist, self._checkpoint_saved)
        self.start_step = self._resume()  # last: restores the random streams too
        self.loggers = build.loggers(pm, cfg, self.run_dir, self.start_step, dist)
        self.status = RunStatus(self.run_dir, dist.is_main, self.plan.resume_from)  # status.json
        # (step, greedy validation score), with those a resumed run logged before its checkpoint
        self.val_scores: list[tuple[int, float]] = logged_val_scores(self.run_dir, self.start_step)

    def _training_state(self) -> TrainingState:
        """What a checkpoint saves and a resume restores (minirl.checkpoint.training)."""
        trainable_only = self.adapter.saves_trainable_only
        parts = ckpt_state.Checkpointable(model=self.actor, optimizer=self.optimizer, trainable_only=trainable_only)
        schedulers = {"actor": self.scheduler}
        if self.critic is not None:
            parts.others["critic"] = (self.critic.model, self.critic.optimizer)
            schedulers["critic"] = self.critic.scheduler
        files = [file_identity(f) for f in self.cfg.data.train_files]
        return TrainingState(parts, schedulers, self.loader, self.guard, self.kl_ctrl, self.source, files)

    # -----------------------------------------------------------------------------------------
    # the loop
    # -----------------------------------------------------------------------------------------

    def fit(self) -> list[dict[str, float]]:
        self.status.update("running", self.start_step)
        try:
            self.sync.start(resumed=self.start_step > 0)
            return self._fit()
        except Stopped:
            raise
        except KeyboardInterrupt:  # a second Ctrl-C: stopped at once, without a checkpoint of this step
            self.status.update("stopped", self.start_step + len(self.history), signal="a second SIGINT")
            raise
        except BaseException as exc:  # what compare says of this run
            self.status.update("crashed", self.start_step + len(self.history), error=describe(exc))
            raise
        finally:  # normal end, an exception, or Stopped: nothing the run started outlives it
            self.checkpoints.close()  # a checkpoint write in flight
            self.precompile.close()
            self.source.close()  # the reward workers, or the rollout ranks
            self.agents.close()

    def _fit(self) -> list[dict[str, float]]:
        t = self.cfg.trainer
        self._print(self._batch_line())
        for line in (self.adapter.describe(t, self.run_dir), self.precompile.describe()):
            if line:
                self._print(line)
        if self.critic is not None:
            self._print(critic_line(self.cfg, self.critic))
        if self.start_step >= self.total_steps:
            self._print(
                f"nothing to train: the checkpoint is at step {self.start_step} of {self.total_steps}, the run is "
                "complete; raise trainer.total_training_steps to continue it, or set trainer.resume_mode = "
                "'disable' to start another run"
            )
        if t.val_before_train and self.start_step == 0:
            self._log(self.source.validate(), step=0)
        bar = tqdm(
            total=self.total_steps,
            initial=self.start_step,
            desc="steps",
            disable=not (t.progress_bar and self.dist.is_main),
        )
        with StopRequest() as stop:
            for step in range(self.start_step + 1, self.total_steps + 1):  # a resume continues the data
                metrics = self.train_step(step)
                if self._is_due(t.test_freq, step):
                    metrics.update(self.source.validate())
                self._log(metrics, step)
                if step == self.start_step + 1:
                    self._first_step_notes(metrics, step)
                self.guard.observe(metrics, step)  # after the log: the bad step is on record
                signum = stop.agreed(self.dist.device)
                self._save_due(step, force=signum is not None)
                if signum is not None:
                    raise self._stopped(signum, step, bar)
                bar.update(1)
        self.checkpoints.wait()  # the last checkpoint complete before the run ends
        self.status.update("finished", self.total_steps)
        return self._finish(bar)

    def _first_step_notes(self, metrics: dict[str, float], step: int) -> None:
        """What this process's first step spent compiling, and (CUDA) what holds the memory."""
        for line in (_compile_note(metrics, step), memory_line(metrics)):
            if line:
                self._print(line)

    def _is_due(self, freq: int, step: int) -> bool:
        """Every `freq` steps and after the last one; never when freq <= 0."""
        return freq > 0 and (step % freq == 0 or step == self.total_steps)

    def _save_due(self, step: int, force: bool = False) -> None:
        t = self.cfg.trainer
        self._prepare_checkpoints(step)
        self.checkpoints.poll()  # a background write that finished: its hook, or its error
        if force or self._is_due(t.save_freq, step):
            self.save(step)
        if self._is_due(t.save_hf_freq, step):
            self.save_hf(os.path.join(self.run_dir, f"hf_step_{step}"))

    def _prepare_checkpoints(self, step: int) -> None:
        """The host buffers of a background save, made once (minirl.checkpoint.staging) when
        the state after `step` is complete: the actor's AdamW state exists after its first update
        (step 1, or the first after the critic's warm-up), so the first save only copies."""
        if self.critic is None or step > self.cfg.trainer.critic_warmup:
            self.checkpoints.prepare(self.state.parts, self.cfg.trainer.save_freq)

    def save(self, step: int) -> str:
        """A full checkpoint of everything the next step depends on (minirl.checkpoint); with
        trainer.async_save it is written in the background once its state is in host memory."""
        return ckpt_training.save(self.state, step, self.cfg, self.run_dir, self.checkpoints)

    def _checkpoint_saved(self, step: int, path: str) -> None:
        self.status.saved(step, path)
        if self.dist.is_main:
            self.pm.hook.minirl_on_checkpoint_saved(step=step, path=path)

    def _resume(self) -> int:
        """Decide the run directory (minirl.checkpoint.resume) and restore the checkpoint it names;
        returns the step to continue after. Decided once everything is built: whether an auto
        resume fits this run depends on the critic, the data and the run's length."""
        self.plan = plan_run(self.cfg.trainer, self.dist)
        if self.plan.resume_from is not None and self.cfg.trainer.resume_mode == "auto":
            why = ckpt_training.why_not_resume(self.plan.resume_from, self.state, self.cfg, self.total_steps)
            self.plan = self.plan.declined(why) if why else self.plan
        self.run_dir = self.plan.run_dir
        self._print(self.plan.notice)
        if self.plan.resume_from is None:
            return 0
        step = ckpt_training.resume(self.plan.resume_from, self.state, self.cfg, self.dist, self._print)
        self._prepare_checkpoints(step)  # the loaded state: one step more to prepare in
        return step

    def _stopped(self, signum: int, step: int, bar) -> Stopped:
        self.checkpoints.wait()
        path = os.path.join(self.run_dir, f"ckpt_{step}")
        self.status.update("stopped", step, signal=signal.Signals(signum).name)
        self._finish(bar)
        how = (
            "run the same command again (trainer.resume_mode = 'auto' resumes from it)"
            if self.cfg.trainer.resume_mode == "auto"
            else f"run again with trainer.resume_mode=resume_path trainer.resume_from_path={path}"
        )
        name = signal.Signals(signum).name
        return Stopped(
            f"stopped by {name} after step {step}: checkpoint {path} written; to resume, {how}", 128 + signum
        )

    def train_step(self, step: int) -> dict[str, float]:
        timer = PhaseTimer(self.dist.device, step)
        with timer.phase("step"):
            rollout = self.source.next(step, timer)  # phases gen and reward
            batch = rollout.batch
            if not self.on_policy and batch.old_log_probs_BT is None:  # else: the source's (behaviour policy)
                with timer.phase("old_log_prob"):
                    batch.old_log_probs_BT = self.log_probs(self.actor, self.old_micro, batch)
            if self.adapter.reference is not None:
                with timer.phase("ref"), self.adapter.reference() as ref:
                    batch.ref_log_probs_BT = self.log_probs(ref, self.ref_micro, batch)
            if self.critic is not None:
                with timer.phase("values"):
                    batch.values_BT = critic_lib.compute_values(self.critic, batch, self.dist)
            with timer.phase("adv"):
                adv_metrics = self.advantages(batch)
            critic_metrics, actor_metrics = {}, {}
            if self.critic is not None:
                with timer.phase("update_critic"):
                    critic_metrics = self.update_critic(batch)
            if self.critic is None or step > self.cfg.trainer.critic_warmup:  # else: critic warm-up
                with timer.phase("update_actor"):
                    actor_metrics = self.update(batch)
            with timer.phase("update_weights"):
                sync_metrics = self.sync.after_update()
        metrics = {**rollout.metrics, **adv_metrics, **critic_metrics, **actor_metrics, **timer.metrics()}
        metrics.update(self.precompile.metrics())
        return {**metrics, **self._batch_metrics(rollout, timer), **sync_metrics, **self._held_memory()}

    def _held_memory(self) -> dict[str, float]:
        """What the actor, its optimizer, the reference and the critic hold (minirl.observe.memory)."""
        ref = self.adapter.reference.model if self.adapter.reference is not None else None
        critic = (self.critic.model, self.critic.optimizer) if self.critic is not None else None
        return held_memory(self.dist.device, self.actor, self.optimizer, ref, critic)

    def _batch_metrics(self, rollout, timer: PhaseTimer) -> dict[str, float]:
        """What the step's batch was: data, agents, the source's own account, throughputs and MFU."""
        batch, dist = rollout.batch, self.dist
        metrics = data_metrics(batch, dist)
        if self.cfg.rollout.multi_turn.enable:
            metrics.update(agent_metrics(batch.trajectories, dist))
        metrics.update(rollout.source_metrics)
        trained = self.adapter.trained_parameters()
        metrics.update(perf_metrics(batch, timer.seconds, self.actor, self.cfg, dist, rollout.generated, trained))
        return metrics

    # -----------------------------------------------------------------------------------------
    # phases
    # -----------------------------------------------------------------------------------------

    def log_probs(self, model, micro, batch: RolloutBatch) -> torch.Tensor:
        """Per-token log-probs [B, T] of the responses under `model` (old or reference policy)."""
        self.precompile.wait()  # the first time: until the twin compiled the layers' graphs
        head = logprob_head(self.actor_update.temperature)
        return per_token_pass(model, batch, micro, head, self.dist)

    def advantages(self, batch: RolloutBatch) -> dict[str, float]:
        rewards_BT, metrics = batch.token_scores_BT, {}
        if self.kl_ctrl is not None:
            kl_fn = self.pm["kl_estimators"].get(self.cfg.algorithm.kl_penalty)
            rewards_BT, mean_kl = apply_kl_in_reward(
                rewards_BT,
                batch.old_log_probs_BT,
                batch.ref_log_probs_BT,
                batch.mask_BT,
                self.kl_ctrl.value,
                kl_fn,
                reduce=self.dist.all_reduce,
            )
            metrics = {"critic/kl": float(mean_kl), "critic/kl_coef": self.kl_ctrl.value}
            self.kl_ctrl.update(float(mean_kl), len(batch) * self.dist.dp_size)
        inputs = AdvantageInputs(
            rewards_BT,
            batch.mask_BT,
            batch.group_B.to(self.dist.device),
            values_BT=batch.values_BT,  # the critic's (gae); None without one
            reduce=self.dist.all_reduce,
        )
        batch.advantages_BT, batch.returns_BT = self.estimator(inputs, self.cfg.algorithm)
        batch.rewards_BT = rewards_BT
        return metrics

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        self.precompile.wait()  # the first time: until the twin compiled the layers' graphs
        self.actor.train()
        metrics = actor_lib.update_actor(self.actor_update, batch, self.dist)
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.actor.eval()
        return metrics

    def update_critic(self, batch: RolloutBatch) -> dict[str, float]:
        critic = self.critic
        critic.model.train()
        metrics = critic_lib.update_critic(critic, batch, self.dist)
        metrics["critic/lr"] = critic.scheduler.get_last_lr()[0]
        critic.scheduler.step()
        critic.model.eval()
        metrics.update(value_metrics(batch, self.dist))
        return metrics

    def save_hf(self, path: str) -> None:
        """The actor as a Hugging Face directory (LoRA: a peft adapter directory; minirl.adapter)."""
        self.adapter.save_hf(self.tokenizer, path, self.dist)

    # -----------------------------------------------------------------------------------------
    # output
    # -----------------------------------------------------------------------------------------

    def _log(self, metrics: dict[str, float], step: int) -> None:
        if step > 0:  # step 0 is the validation before training
            self.history.append(metrics)
        if "val/score/mean" in metrics:
            self.val_scores.append((step, metrics["val/score/mean"]))
        self.pm.hook.minirl_on_step_end(step=step, metrics=metrics)
        for logger in self.loggers:
            logger.log(metrics, step)

    def _finish(self, bar) -> list[dict[str, float]]:
        bar.close()
        for logger in self.loggers:
            logger.close()
        if self.history:
            skipped = {"old_log_prob": self._old_log_probs_note()}  # shown where no step ran the pass
            self._print("\n" + summary_table(self.history, first_step=self.start_step + 1, skipped=skipped))
        if self.val_scores:
            scores = " -> ".join(f"{score:.3f} (step {step})" for step, score in self.val_scores)
            self._print(f"validation score (greedy, data.val_files): {scores}")
        files = (["metrics.jsonl"] if "jsonl" in self.cfg.trainer.logger else []) + ["config.toml"]
        self._print(self.status.end_line(files))
        return self.history

    def _print(self, text: str) -> None:
        if self.dist.is_main:
            print(text, flush=True)

    def _old_log_probs_note(self) -> str:
        if self.on_policy:
            return "from the update's forward (on-policy: no prev-log-prob pass)"
        return self.source.old_log_probs_note

    def _batch_line(self) -> str:
        """The one line that spells out the effective batch."""
        d, a, dist = self.cfg.data, self.cfg.actor, self.dist
        minis = d.train_batch_size // a.ppo_mini_batch_size
        old = self._old_log_probs_note()
        return (
            f"batch: {d.train_batch_size} prompts x n={self.cfg.rollout.n} = {d.train_batch_size * self.cfg.rollout.n} "
            f"sequences/step; {minis} mini-batch(es) of {a.ppo_mini_batch_size} prompts x {a.ppo_epochs} epoch(s) = "
            f"{minis * a.ppo_epochs} optimizer steps/step; micro-batches: {self.actor_update.update.micro.describe()}; "
            f"old log-probs: {old}; world {dist.world_size} (dp {dist.dp_size}, sp {dist.sp_size}){_threads(dist)}; "
            f"{self.loader.steps_per_epoch} steps/epoch, {self.total_steps} steps"
            f"{_filter_groups_note(self.cfg.algorithm.filter_groups)}{_tis_note(self.cfg)}"
        )


def _compile_note(metrics: dict[str, float], step: int) -> str:
    """The first step's compiling: its seconds and graphs, those inductor's cache held (compiled
    ahead by minirl.precompile's twin, or by an earlier run), and the wait for the twin."""
    seconds = metrics.get("compile/seconds", 0.0)
    if seconds < 1.0:
        return ""
    graphs, hits = int(metrics.get("compile/graphs", 0)), int(metrics.get("compile/cache_hits", 0))
    found = f", {hits} found compiled in inductor's cache" if hits else ""
    if metrics.get("compile/precompile_wait_s", 0.0) >= 0.1:
        found += f", {metrics['compile/precompile_wait_s']:.1f} s waited for the second process"
    if metrics.get("compile/precompile_unfinished"):
        done = int(metrics.get("compile/precompile_passes", 0))
        total = done + int(metrics["compile/precompile_unfinished"])
        found += f"; the second process had compiled {done} of {total} passes' graphs when this step needed them"
    return (
        f"compiling: {seconds:.1f} s of step {step}'s {metrics['timing_s/step']:.1f} s ({graphs} graphs{found}; "
        "model.compile_layers, fused kernels); later steps reuse them"
    )


def _threads(dist: DistContext) -> str:
    return f", {spmd.threads_note()}" if dist.device.type == "cpu" else ""


def _tis_note(cfg: Config) -> str:
    cap = cfg.actor.tis_imp_ratio_cap
    return f"; TIS cap {cap} ({cfg.origin('actor.tis_imp_ratio_cap')})" if cap > 0 else ""


def _filter_groups_note(fg) -> str:
    if not fg.enable:
        return ""
    cap = f"at most {fg.max_num_gen_batches}" if fg.max_num_gen_batches > 0 else "no cap on the"
    return f"; dynamic sampling: groups with equal {fg.metric} dropped, {cap} prompt batches per step"
