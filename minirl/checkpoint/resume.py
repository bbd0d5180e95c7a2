"""Where a run writes and what it resumes from (trainer.resume_mode), decided once at start.

- `auto` (default): the newest complete checkpoint of the run directory, else a fresh start;
- `resume_path`: the checkpoint trainer.resume_from_path names;
- `disable`: a fresh start.
A fresh start never touches a previous run's output: a run directory that already holds one is
left as it is and the run goes to the next free `<name>-2`, `<name>-3`, ...; `auto` looks at the
newest of these. One line says which of these happened.

A resume whose checkpoint was written with different values of keys that change the math is
refused with the keys listed (trainer.resume_ignore_config_changes = true overrides); keys that
only change speed, memory, logging or the run's length may differ.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from typing import Any

import torch.distributed as tdist

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 only
    import tomli as tomllib

from minirl.checkpoint import store
from minirl.config.load import flatten
from minirl.errors import UserError

MODES = ("auto", "disable", "resume_path")

# keys that may change between a checkpoint and its resume: speed, memory, logging, length
_FREE_KEYS = {
    "trainer": (
        "project_name experiment_name total_epochs total_training_steps n_gpus_per_node nnodes world_size "
        "device default_local_dir logger progress_bar test_freq save_freq save_hf_freq max_ckpt_to_keep "
        "resume_mode resume_from_path resume_ignore_config_changes val_before_train collective_timeout_s "
        "peak_flops max_nonfinite_steps launcher ray_address ray_placement_timeout_s"
    ),
    "data": "val_files",
    "reward": "num_workers timeout_s",
    "model": "enable_gradient_checkpointing compile_layers fused_mlp",
    "actor": "ppo_micro_batch_size_per_gpu use_dynamic_bsz ppo_max_token_len_per_gpu ulysses_sequence_parallel_size",
    "critic": (
        "ppo_micro_batch_size_per_gpu use_dynamic_bsz ppo_max_token_len_per_gpu ulysses_sequence_parallel_size "
        "forward_micro_batch_size_per_gpu forward_max_token_len_per_gpu"
    ),
    "critic.model": "enable_gradient_checkpointing compile_layers fused_mlp",
    "rollout": (
        "gpu_memory_utilization kv_cache_dtype max_num_seqs enforce_eager free_cache_engine "
        "log_prob_micro_batch_size_per_gpu "
        "log_prob_use_dynamic_bsz log_prob_max_token_len_per_gpu calculate_log_probs"
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
    run_dir = _newest_of_family(os.path.join(t.default_local_dir, t.experiment_name))
    if t.resume_mode not in MODES:
        raise UserError(f"trainer.resume_mode = {t.resume_mode!r}: use one of {', '.join(MODES)}")
    if t.resume_mode == "resume_path":
        return _plan_from_path(t, run_dir)
    found = store.complete_checkpoints(run_dir)
    if t.resume_mode == "auto" and found:
        step, path = found[-1]
        return RunPlan(run_dir, path, f"resuming from step {step}: {path} (trainer.resume_mode = 'auto')")
    if not _holds_output(run_dir):
        return RunPlan(run_dir, None, f"starting fresh in {run_dir} (no checkpoint to resume)")
    fresh = _next_free(run_dir)
    why = "trainer.resume_mode = 'disable'" if t.resume_mode == "disable" else "it has no complete checkpoint"
    return RunPlan(fresh, None, f"starting fresh in {fresh}: {run_dir} holds a previous run ({why}), left untouched")


def _plan_from_path(t, run_dir: str) -> RunPlan:
    path = t.resume_from_path
    if not path:
        raise UserError("trainer.resume_mode = 'resume_path' needs trainer.resume_from_path: a ckpt_<step> directory")
    if not os.path.isdir(path):
        raise UserError(f"trainer.resume_from_path = {path!r} is not a directory; point it at a ckpt_<step> directory")
    step = int(store.verify(path)["step"])
    return RunPlan(run_dir, path, f"resuming from step {step}: {path} (trainer.resume_from_path)")


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


def _newest_of_family(base: str) -> str:
    existing = [d for d in _family(base) if os.path.isdir(d)]
    return existing[-1] if existing else base


def _next_free(run_dir: str) -> str:
    base = run_dir.rsplit("-", 1)[0] if _is_family_member(run_dir) else run_dir
    return f"{base}-{len(_family(base)) + 1}"


def _is_family_member(run_dir: str) -> bool:
    head, _, tail = run_dir.rpartition("-")
    return bool(head) and tail.isdigit() and int(tail) >= 2 and os.path.isdir(head)


# ---------------------------------------------------------------------------------------------
# the config a checkpoint was written with
# ---------------------------------------------------------------------------------------------


def check_config(
    saved_toml: str,
    current: dict,
    path: str,
    ignore: bool,
    defaults: dict | None = None,
    unused: tuple[str, ...] = (),
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
