"""Where a run writes and what it resumes from (trainer.resume_mode), decided once at start, and
the config check of a resume (README.md, Resuming). A fresh start never touches a previous run's
output: it goes to the next free `<name>-2`, `<name>-3`, ...; `auto` resumes the newest of these
unless it is another run's: complete, or written with other values of a key that changes the math
(the keys of speed, memory, logging and the run's length, FREE_KEYS, may differ). Then `auto`
starts fresh and says why; an explicit `resume_path` is refused instead.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch.distributed as tdist

from minirl.checkpoint import store
from minirl.config.load import flatten, tomllib  # tomli on Python 3.10
from minirl.errors import UserError

MODES = ("auto", "disable", "resume_path")

# keys that may change between a checkpoint and its resume: speed, memory, logging, length
_MODEL_KEYS = "enable_gradient_checkpointing recompute_num_layers compile_layers fused_mlp"  # model and critic.model
_UPDATE_KEYS = "ppo_micro_batch_size_per_gpu use_dynamic_bsz ppo_max_token_len_per_gpu ulysses_sequence_parallel_size"
_FREE_KEYS = {
    "trainer": (
        "project_name experiment_name total_epochs total_training_steps n_gpus_per_node nnodes world_size "
        "device default_local_dir logger progress_bar test_freq save_freq save_hf_freq max_ckpt_to_keep async_save "
        "resume_mode resume_from_path resume_ignore_config_changes val_before_train collective_timeout_s "
        "peak_flops max_nonfinite_steps launcher ray_address ray_placement_timeout_s"
    ),
    "data": "val_files",
    "reward": "num_workers timeout_s",
    "model": _MODEL_KEYS + " lora_save_merged",  # LoRA: the merged export is output only
    "actor": _UPDATE_KEYS,
    "critic": _UPDATE_KEYS + " forward_micro_batch_size_per_gpu forward_max_token_len_per_gpu",
    "critic.model": _MODEL_KEYS,
    "rollout": (
        "gpu_memory_utilization kv_cache_dtype quantization max_num_seqs enforce_eager free_cache_engine "
        "calculate_log_probs log_prob_micro_batch_size_per_gpu log_prob_use_dynamic_bsz log_prob_max_token_len_per_gpu"
    ),
    "ref": (
        "log_prob_micro_batch_size_per_gpu log_prob_use_dynamic_bsz log_prob_max_token_len_per_gpu offload "
        "ulysses_sequence_parallel_size"
    ),
    "plugins": "modules",
}
FREE_KEYS = {f"{section}.{key}" for section, keys in _FREE_KEYS.items() for key in keys.split()}
FREE_PREFIXES = ("actor.fsdp_config.", "ref.fsdp_config.", "critic.fsdp_config.")


@dataclass(frozen=True)
class RunPlan:
    run_dir: str
    resume_from: str | None  # a complete checkpoint directory, or None for a fresh start
    notice: str  # the line printed at start
    fresh_dir: str = ""  # where a declined auto-resume starts fresh (chosen on rank 0 like run_dir)

    def declined(self, why: str) -> RunPlan:
        """A fresh start instead of resuming `resume_from` (auto mode), for the reason `why`."""
        return RunPlan(self.fresh_dir, None, f"starting fresh in {self.fresh_dir}, not resuming: {why}")


def plan_run(trainer_cfg, dist) -> RunPlan:
    """Decided on rank 0 (which also removes half-written checkpoints) and sent to every rank."""
    box: list[Any] = [None]
    if dist.is_main:
        box[0] = _plan(trainer_cfg)
        for tmp in store.stale_temporaries(box[0].run_dir):
            shutil.rmtree(tmp, ignore_errors=True)  # a write that was cut short; never complete
    if tdist.is_available() and tdist.is_initialized():
        tdist.broadcast_object_list(box, src=0)
    return box[0]


def _plan(t) -> RunPlan:
    assert t.resume_mode in MODES, "validation checks trainer.resume_mode"
    base = os.path.join(t.default_local_dir, t.experiment_name)
    family = _family(base)
    run_dir = next((d for d in reversed(family) if os.path.isdir(d)), base)  # the newest fresh start
    if t.resume_mode == "resume_path":
        return _plan_from_path(t, run_dir)
    fresh = f"{base}-{len(family) + 1}"
    if t.resume_mode == "auto" and store.complete_checkpoints(run_dir):
        step, path, warnings = newest_intact(run_dir)
        notice = "".join(f"minirl: warning: {w}\n" for w in warnings)
        notice += f"resuming from step {step}: {path} (trainer.resume_mode = 'auto')"
        return RunPlan(run_dir, path, notice, fresh)
    if not _holds_output(run_dir):
        return RunPlan(run_dir, None, f"starting fresh in {run_dir} (no checkpoint to resume)")
    why = "trainer.resume_mode = 'disable'" if t.resume_mode == "disable" else "it has no complete checkpoint"
    return RunPlan(fresh, None, f"starting fresh in {fresh}: {run_dir} holds a previous run ({why}), left untouched")


def _plan_from_path(t, run_dir: str) -> RunPlan:
    path = t.resume_from_path
    assert path, "validation checks that resume_mode = 'resume_path' has a path"
    if not os.path.isdir(path):
        raise UserError(f"trainer.resume_from_path = {path!r} is not a directory; point it at a ckpt_<step> directory")
    damaged = store.damaged_files(path)
    if damaged:
        older = [p for _, p in store.complete_checkpoints(os.path.dirname(os.path.abspath(path))) if p != path]
        fix = f"point trainer.resume_from_path at an older one ({older[-1]})" if older else "there is no older one"
        raise UserError(f"checkpoint {path} is damaged: {damaged[0]} (the file changed after it was written); {fix}")
    step = int(store.verify(path)["step"])
    return RunPlan(run_dir, path, f"resuming from step {step}: {path} (trainer.resume_from_path)")


def newest_intact(run_dir: str) -> tuple[int, str, list[str]]:
    """(step, path, warnings) of the newest complete checkpoint whose files all match their
    checksums. A damaged one is renamed to `<name>.damaged` (kept for inspection, never resumed
    or pruned) with a warning naming the file; none left intact stops the run."""
    warnings = []
    for step, path in reversed(store.complete_checkpoints(run_dir)):
        try:
            damaged = store.damaged_files(path)
        except UserError as exc:  # a missing or truncated file
            damaged = [str(exc)]
        if not damaged:
            return step, path, warnings
        aside = path + store.DAMAGED_SUFFIX
        shutil.rmtree(aside, ignore_errors=True)  # the same step found damaged before
        os.rename(path, aside)
        more = f" and {len(damaged) - 1} more" if len(damaged) > 1 else ""
        warnings.append(
            f"checkpoint {path} is damaged ({damaged[0]}{more}); moved to {aside}, falling back to the "
            "previous complete checkpoint"
        )
    raise UserError(
        f"no intact checkpoint left in {run_dir}: {'; '.join(warnings)}. Restore the files from a copy, or start "
        "fresh (trainer.resume_mode = 'disable')"
    )


def _holds_output(run_dir: str) -> bool:
    """True when run_dir has anything beyond what a run that died at start-up leaves."""
    if not os.path.isdir(run_dir):
        return False
    for name in os.listdir(run_dir):
        full = os.path.join(run_dir, name)
        if name == "config.toml" or name.startswith(store.TMP_PREFIX):
            continue
        if name == "metrics.jsonl" and os.path.getsize(full) == 0:
            continue
        return True
    return False


def _family(base: str) -> list[str]:
    """base, base-2, base-3, ... as long as they exist: the fresh starts of one experiment name."""
    members, n = [base], 2
    while os.path.isdir(f"{base}-{n}"):
        members.append(f"{base}-{n}")
        n += 1
    return members


def check_config(
    saved_toml: str, current: dict, path: str, ignore: bool, defaults: dict | None = None, unused: tuple[str, ...] = ()
) -> list[str]:
    """The math-changing differences; raises unless `ignore` (then the caller reports them).
    `defaults` and `unused`: as config_differences takes them."""
    diffs = config_differences(tomllib.loads(saved_toml), current, defaults, unused)
    if diffs and not ignore:
        raise UserError(
            f"resume refused: checkpoint {path} was written with other values of keys that change the "
            f"math: {'; '.join(diffs)}. Restore them, set trainer.resume_ignore_config_changes = true, "
            "or start fresh (trainer.resume_mode = 'disable' or a new trainer.experiment_name)"
        )
    return diffs


def config_differences(
    saved: dict, current: dict, defaults: dict | None = None, unused: tuple[str, ...] = ()
) -> list[str]:
    """'key = saved (checkpoint) vs now' for every math-changing key whose value differs.

    A key the checkpoint's config lacks (one added to minirl after it was written) counts as
    its default from `defaults` (same layout as `current`), so an upgrade alone never blocks a
    resume; a key whose new default differs from what it replaced is a change the keys list.
    Keys starting with an `unused` prefix change nothing in this run (a critic-free run's
    [critic] section)."""
    old, new, base = flatten(saved), flatten(current), flatten(defaults or {})
    diffs = []
    for key in sorted(set(old) | set(new)):
        if key in FREE_KEYS or key.startswith(FREE_PREFIXES + unused):
            continue
        a, b = old.get(key, base.get(key)), new.get(key)
        if a != b and not (_is_nan(a) and _is_nan(b)):
            diffs.append(f"{key} = {a!r} (checkpoint) vs {b!r} (now)")
    return diffs


def _is_nan(x: Any) -> bool:
    return isinstance(x, float) and x != x
