"""The trainer's side of a checkpoint: which objects a step's state lives in, what goes into
trainer_state.json, and restoring all of it (minirl.checkpoint.state moves the bytes).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from minirl.checkpoint import state as ckpt_state
from minirl.checkpoint.resume import check_config, config_differences
from minirl.checkpoint.writer import CheckpointWriter
from minirl.config.load import Config, to_toml, tomllib
from minirl.data import identity
from minirl.dist.context import DistContext
from minirl.errors import UserError


@dataclass
class TrainingState:
    """Everything the next step depends on besides the config: the models and optimizers (DCP
    shards), LR schedulers by name, the prompt loader (its data position: `drawn` batches, more
    than one a step with dynamic sampling), the non-finite step guard, the adaptive KL controller
    (or None) and the batch source's position (an asynchronous job's next batch and weight
    version; saved as "extra")."""

    parts: ckpt_state.Checkpointable
    schedulers: dict[str, Any]
    loader: Any
    guard: Any
    kl_ctrl: Any = None
    source: Any = None  # state_dict() / load_state_dict() of JSON-able values
    data_files: list[dict] = field(default_factory=list)  # minirl.data.identity of data.train_files

    def to_json(self, step: int, seed: int, world_size: int) -> dict:
        per_epoch, drawn = self.loader.steps_per_epoch, self.loader.drawn
        return {
            "step": step,
            "data": {
                "batches_drawn": drawn,
                "epoch": drawn // per_epoch,
                "batch_in_epoch": drawn % per_epoch,
                "steps_per_epoch": per_epoch,
                "num_prompts": len(self.loader.records),
                "shuffle_seed": self.loader.seed,
                "files": self.data_files,
            },
            "schedulers": {name: s.state_dict() for name, s in self.schedulers.items()},
            "kl_coef": None if self.kl_ctrl is None else self.kl_ctrl.value,
            "nonfinite_guard": self.guard.state_dict(),
            "extra": self.source.state_dict() if self.source is not None else {},
            "seed": seed,
            "world_size": world_size,
        }

    def restore(self, saved: dict, path: str) -> None:
        for name, scheduler in self.schedulers.items():
            if name not in saved.get("schedulers", {}):
                raise UserError(
                    f"checkpoint {path} has no '{name}' state (it was written by a run without it); "
                    "resume from a checkpoint of the same setup, or start fresh (trainer.resume_mode = 'disable')"
                )
            scheduler.load_state_dict(saved["schedulers"][name])
        if self.kl_ctrl is not None and saved.get("kl_coef") is not None:
            self.kl_ctrl.value = float(saved["kl_coef"])
        self.guard.load_state_dict(saved.get("nonfinite_guard", self.guard.state_dict()))
        data = saved["data"]  # checkpoints before dynamic sampling have no batches_drawn
        self.loader.drawn = data.get("batches_drawn", data["epoch"] * data["steps_per_epoch"] + data["batch_in_epoch"])
        if self.source is not None:
            self.source.load_state_dict(saved.get("extra", {}))


def writer(trainer_cfg, dist: DistContext, on_saved: Callable[[int, str], None]) -> CheckpointWriter:
    """The run's checkpoint writer: in the background when trainer.async_save."""
    return CheckpointWriter(dist, trainer_cfg.async_save, trainer_cfg.collective_timeout_s, on_saved)


def save(state: TrainingState, step: int, cfg: Config, run_dir: str, out: CheckpointWriter) -> str:
    """Write ckpt_<step> through `out` (every rank calls); returns its path."""
    t = cfg.trainer
    trainer_state = state.to_json(step, t.seed, out.dist.world_size)
    return out.save(run_dir, step, state.parts, trainer_state, to_toml(cfg), t.max_ckpt_to_keep)


def why_not_resume(path: str, state: TrainingState, cfg: Config, total_steps: int) -> str | None:
    """Why checkpoint `path`, found by trainer.resume_mode = 'auto', belongs to another run (None:
    resume it). Running a command again means to continue it; a changed key that changes the math,
    other training data or a finished run means a new run, which auto starts fresh."""
    saved = ckpt_state.read_trainer_state(path)
    step, run_dir = int(saved["step"]), os.path.dirname(path)
    diffs = []
    if not cfg.trainer.resume_ignore_config_changes:
        diffs = config_differences(tomllib.loads(ckpt_state.read_config(path)), cfg.to_dict(), *_baseline(cfg, state))
        diffs += _data_differences(state.loader, saved["data"])
    if diffs:  # the likelier reason first: the user changed the job
        return (
            f"{path} was written with other values of keys that change the math: {'; '.join(diffs)} "
            "(trainer.resume_ignore_config_changes = true resumes it anyway)"
        )
    if step >= total_steps:
        return (
            f"the run in {run_dir} is complete (its checkpoint is at step {step}, this run has {total_steps} "
            "steps); raise trainer.total_training_steps to continue it instead"
        )
    return None


def resume(path: str, state: TrainingState, cfg: Config, dist: DistContext, say: Callable[[str], None]) -> int:
    """Restore `state` from checkpoint `path`; returns the step to continue after."""
    t = cfg.trainer
    saved = ckpt_state.read_trainer_state(path)
    diffs = check_config(
        ckpt_state.read_config(path), cfg.to_dict(), path, t.resume_ignore_config_changes, *_baseline(cfg, state)
    )
    if diffs:
        say(f"minirl: resuming despite config changes (trainer.resume_ignore_config_changes): {'; '.join(diffs)}")
    _check_data_files(saved["data"].get("files"), state.data_files, path, t.resume_ignore_config_changes, say)
    changed = _data_differences(state.loader, saved["data"])
    if changed and not t.resume_ignore_config_changes:
        raise UserError(
            f"resume refused: the training data differs from checkpoint {path}'s ({', '.join(changed)}), so "
            "its data position would point at other prompts; restore data.train_files and the filters, or "
            "set trainer.resume_ignore_config_changes = true"
        )
    ckpt_state.load(path, state.parts, dist)
    state.restore(saved, path)
    if saved.get("world_size") != dist.world_size:
        say(
            f"minirl: the checkpoint was written by {saved.get('world_size')} rank(s), this run has "
            f"{dist.world_size}: weights and optimizer state are resharded; the run is not bit-identical "
            "to an uninterrupted one"
        )
    return int(saved["step"])


def _check_data_files(saved: list[dict] | None, now: list[dict], path: str, ignore: bool, say) -> None:
    """A resume over changed training files would continue at the old data position in other
    prompts: refused, naming the files, whichever resume mode (unlike a changed config key, a
    file replaced under the same name is rarely meant as a new run). A checkpoint written before
    identities were recorded (None) is not checked."""
    if saved is None or not now:
        return
    changed, touched = identity.changed_files(saved, now)
    if changed and not ignore:
        raise UserError(
            f"resume refused: the training data changed since checkpoint {path} was written ({'; '.join(changed)}), "
            "so its data position would point at other prompts; restore the files, start fresh "
            "(trainer.resume_mode = 'disable'), or set trainer.resume_ignore_config_changes = true to resume anyway"
        )
    if changed:
        say(f"minirl: resuming despite changed data files (trainer.resume_ignore_config_changes): {'; '.join(changed)}")
    if touched:
        say(f"minirl: data files modified since the checkpoint (same size and row groups): {', '.join(touched)}")


def _baseline(cfg: Config, state: TrainingState) -> tuple[dict, tuple[str, ...]]:
    """config_differences' `defaults` (for keys an older checkpoint lacks) and `unused` prefixes."""
    defaults = {name: dataclasses.asdict(type(section)()) for name, section in cfg.sections.items()}
    unused = () if "critic" in state.schedulers else ("critic.", "trainer.critic_warmup")  # no critic: no effect
    return defaults, unused


def _data_differences(loader, data: dict) -> list[str]:
    """The saved position (epoch, batch) means the same prompts only over the same data."""
    now = {"steps_per_epoch": loader.steps_per_epoch, "num_prompts": len(loader.records)}
    return [f"{k} {data.get(k)} (checkpoint) vs {v} (now)" for k, v in now.items() if data.get(k) != v]
