"""Writing and reading a full checkpoint on every rank (docs/architecture.md, Checkpoints and resume).

ckpt_<step>/
  .metadata, __<r>_<i>.distcp   models and optimizers (torch.distributed.checkpoint): each rank
                                writes its own shards, a load reshards them to the current mesh
  rng/rank<r>.pt                each rank's random streams: torch CPU (and CUDA), python, numpy
                                (minirl.checkpoint.rng)
  trainer_state.json            what the trainer puts there (rank 0)
  config.toml                   the config the checkpoint was written with (rank 0)
  manifest.json                 last: every file, its size and CRC-32C (minirl.checkpoint.store)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from minirl.checkpoint import checksum, rng, store
from minirl.dist import fault
from minirl.dist.context import DistContext
from minirl.errors import UserError

TRAINER_STATE = "trainer_state.json"
CONFIG = "config.toml"


@dataclass
class Checkpointable:
    """The objects whose state a checkpoint carries besides trainer_state.json: the actor and
    its optimizer, and further (model, optimizer) pairs by name (the critic), stored under
    "<name>_model" / "<name>_optim"."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    others: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] = field(default_factory=dict)
    # the actor's parameters that train and their optimizer state only: the model adapter says
    # (minirl.adapter; LoRA rebuilds its frozen base from model.path / model.preset)
    trainable_only: bool = False

    def _pairs(self) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
        return {"": (self.model, self.optimizer), **{f"{k}_": v for k, v in self.others.items()}}

    def state_dicts(self) -> dict[str, Any]:
        """The DCP state: every model's and optimizer's (sharded) state dict by key."""
        state = {}
        for prefix, (model, optimizer) in self._pairs().items():
            options = self._options(prefix)
            state[f"{prefix}model"], state[f"{prefix}optim"] = get_state_dict(model, optimizer, options=options)
        return state

    def load_state_dicts(self, state: dict[str, Any]) -> None:
        for prefix, (model, optimizer) in self._pairs().items():
            set_state_dict(
                model,
                optimizer,
                model_state_dict=state[f"{prefix}model"],
                optim_state_dict=state[f"{prefix}optim"],
                options=self._options(prefix),
            )

    def _options(self, prefix: str) -> StateDictOptions | None:
        """The actor's trainable parameters only (trainable_only); the full state otherwise."""
        if prefix or not self.trainable_only:
            return None
        return StateDictOptions(ignore_frozen_params=True, strict=False)


class CheckpointWriteError(UserError):
    """A checkpoint could not be written (full disk, I/O error, no permission): the previous
    checkpoint is untouched and the temporary directory removed."""


@dataclass
class Snapshot:
    """One checkpoint's contents, taken at its step: the DCP state (the live tensors for a
    write that blocks, host copies for one in the background: minirl.checkpoint.staging) and
    the small files by path (this rank's random streams; rank 0: trainer state and config)."""

    step: int
    state: dict[str, Any]
    files: dict[str, bytes]


def snapshot(parts: Checkpointable, trainer_state: dict, config_toml: str, dist, staging=None) -> Snapshot:
    """What ckpt_<step> will hold, as of now (`staging`: copy the tensors to host buffers)."""
    state = parts.state_dicts()
    if staging is not None:
        state = staging.stage(state)
    files = {os.path.join("rng", f"rank{dist.rank}.pt"): rng.capture(dist.device)}
    if dist.is_main:
        files[TRAINER_STATE] = json.dumps(trainer_state, indent=1).encode()
        files[CONFIG] = config_toml.encode()
    return Snapshot(int(trainer_state["step"]), state, files)


def save(run_dir: str, step: int, parts: Checkpointable, trainer_state: dict, config_toml: str, dist, keep: int) -> str:
    """Write ckpt_<step> now, blocking (every rank must call); returns its path."""
    return write(run_dir, snapshot(parts, trainer_state, config_toml, dist), dist, keep)


def write(run_dir: str, snap: Snapshot, dist, keep: int, group=None) -> str:
    """Write ckpt_<snap.step> atomically (every rank must call); returns its path on every rank.
    A write that fails on any rank fails on every rank with one CheckpointWriteError (the ranks
    agree after each stage, so none waits for another in a barrier). `group`: the process group
    of the write's collectives (None: the default one; a background write has its own)."""
    tmp = os.path.join(run_dir, f"{store.TMP_PREFIX}{snap.step}")
    sums: dict[str, tuple[int, str]] = {}

    def write_files() -> None:
        sums.update(_write_rank_files(tmp, snap, group))

    def publish() -> None:
        # the manifest only once every rank's files are written and synced
        all_sums = {k: v for rank_sums in _gather(group, sums) for k, v in rank_sums.items()}
        if dist.is_main:
            store.write_manifest(tmp, snap.step, all_sums)
            store.publish(tmp, run_dir, snap.step, keep)

    for stage, everyone in ((lambda: _make_tmp(tmp), False), (write_files, True), (publish, True)):
        failed = _agreed_failure(group, _attempt(stage if everyone or dist.is_main else lambda: None))
        if failed is not None:
            if dist.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointWriteError(_write_error_line(failed, tmp, run_dir, snap.state, group))
    return os.path.join(run_dir, store.ckpt_name(snap.step))


def _make_tmp(tmp: str) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.join(tmp, "rng"))


def _write_rank_files(tmp: str, snap: Snapshot, group=None) -> dict:
    """This rank's files (its DCP shards, its RNG; rank 0 also the trainer state and the config),
    each with its (size, CRC-32C) by path relative to tmp."""
    sums = _dcp_save(snap.state, tmp, snap.step, group)
    fault.point("checkpoint", snap.step)
    for rel, data in snap.files.items():
        sums[rel] = store.write_file_durably(os.path.join(tmp, rel), data)
    return sums


def _attempt(fn) -> str | None:
    """None when fn() succeeds, else the OSError it raised (DCP wraps a writer thread's error in
    its CheckpointException, a BaseException) as one line."""
    try:
        fn()
    except OSError as exc:
        return _os_error_line(exc)
    except CheckpointException as exc:
        inner = [e for e, _ in exc.failures.values() if isinstance(e, OSError)]
        if not inner:
            raise
        return _os_error_line(inner[0])
    return None


def _os_error_line(exc: OSError) -> str:
    where = f" ({exc.filename})" if exc.filename else ""
    return f"{exc.strerror or exc}{where}"


def _gather(group, obj: Any) -> list[Any]:
    """Every rank's obj over `group` (None: the default group)."""
    if _no_dist():
        return [obj]
    out: list[Any] = [None] * tdist.get_world_size(group)
    tdist.all_gather_object(out, obj, group=group)
    return out


def _agreed_failure(group, error: str | None) -> str | None:
    """The first rank's error ("rank r: ...") when any rank failed, on every rank; else None."""
    errors = _gather(group, error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not failed:
        return None
    rank, text = failed[0]
    return text if len(errors) == 1 else f"rank {rank}: {text}"


def _write_error_line(error: str, tmp: str, run_dir: str, state: dict, group) -> str:
    need = sum(_gather(group, _state_bytes(state)))
    previous = store.complete_checkpoints(run_dir)
    prev = previous[-1][1] if previous else None
    if prev:
        need = max(need, store.total_size(prev))
    kept = f"the previous checkpoint {prev} is intact" if prev else "there is no earlier checkpoint"
    return (
        f"writing checkpoint {tmp} failed: {error}; it needs about {_gb(need)} and {run_dir} has {_gb(_free(run_dir))} "
        f"free; the partial write was removed and {kept}. Free space (or fix the permission), or point "
        "trainer.default_local_dir at another disk, then run the same command again to resume"
    )


def _state_bytes(state: dict) -> int:
    """This rank's bytes of model and optimizer state (its shards), what its DCP files hold."""
    total = 0
    for value in _tensors(state):
        local = value.to_local() if hasattr(value, "to_local") else value
        total += local.numel() * local.element_size()
    return total


def _tensors(tree: Any):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)
    elif torch.is_tensor(tree):
        yield tree


def _free(path: str) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def load(path: str, parts: Checkpointable, dist: DistContext) -> dict:
    """Restore parts and this rank's random streams from `path`; returns trainer_state.json."""
    store.verify(path)
    trainer_state = read_trainer_state(path)
    _dcp_load(parts, path)
    rng.restore(path, dist, trainer_state)
    return trainer_state


def read_trainer_state(path: str) -> dict:
    return store.read_json(os.path.join(path, TRAINER_STATE))


def read_config(path: str) -> str:
    with open(os.path.join(path, CONFIG)) as f:
        return f.read()


def _no_dist() -> bool:
    return not (tdist.is_available() and tdist.is_initialized())


# files each rank writes in parallel; measured on one H200 (docs/benchmarks.md, checkpoint rows)
WRITE_THREADS = int(os.environ.get("MINIRL_CKPT_WRITE_THREADS", "4"))


def _dcp_save(state: dict, path: str, step: int | None = None, group=None) -> dict[str, tuple[int, str]]:
    """Write this rank's shards of `state` (rank 0: also .metadata); returns their (size, CRC-32C)
    by name. An error in any of DCP's writer threads is raised here (DCP drops a helper thread's).
    Safe on a background thread: the process-wide settings it changes (the thread exception hook,
    torch.save's record CRC) are not touched by the training loop."""
    writer = dcp.FileSystemWriter(path, thread_count=WRITE_THREADS, sync_files=True)
    # hashes each byte on its way to the file, one hashing thread per writer thread
    fs = writer.fs = checksum.HashingFileSystem(path, step, hash_threads=WRITE_THREADS)
    previous, zip_crc = threading.excepthook, torch.serialization.get_crc32_options()
    threading.excepthook = lambda args: None if args.exc_value in fs.errors else previous(args)
    # torch.save's own CRC-32 of each record is a second pass over the bytes (1.6 GB/s a core)
    # before each write, and torch.load never checks it: the manifest's CRC-32C covers them
    torch.serialization.set_crc32_options(False)
    # DCP warns that it assumes one process when there is no process group (so do we); a filter,
    # not catch_warnings, which is not thread-safe
    warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
    try:
        dcp.save(state, storage_writer=writer, process_group=group, no_dist=_no_dist())
    finally:
        threading.excepthook = previous
        torch.serialization.set_crc32_options(zip_crc)
        fs.close()
    if fs.errors:
        raise fs.errors[0]
    return dict(fs.sums)


def _last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[-1] if lines else type(exc).__name__
    return text if len(text) <= 240 else text[:237] + "..."


_SINGLE_PROCESS_WARNING = ".*assuming the intent is to (save|load) in a single process"


@contextlib.contextmanager
def _quiet_dcp_load():
    """DCP warns that it assumes one process when there is no process group (so do we), and a
    failed read logs its tracebacks before raising (the raised error is what we report)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        logging.disable(logging.ERROR)
        try:
            yield
        finally:
            logging.disable(logging.NOTSET)


def _dcp_load(parts: Checkpointable, path: str) -> None:
    # the target state dicts give DCP the current sharding; it reads each rank's slices
    state = parts.state_dicts()
    try:
        with _quiet_dcp_load():
            dcp.load(state, checkpoint_id=path, no_dist=_no_dist())
    except (Exception, CheckpointException) as exc:  # DCP's own exception is a BaseException
        raise UserError(
            f"checkpoint {path}: reading the model/optimizer shards (.metadata, __*.distcp) failed "
            f"({_last_line(exc)}); the files are damaged or were written for another model; resume "
            "from an older checkpoint"
        ) from None
    parts.load_state_dicts(state)


def load_model_weights(path: str, model: torch.nn.Module, trainable_only: bool) -> None:
    """The actor's weights of checkpoint `path` into `model` (one process, no optimizer state):
    `python -m minirl export` and `eval`. trainable_only: the checkpoint holds the parameters that
    train only (LoRA's adapters; the rest is the base model, built from model.path / model.preset)."""
    store.verify(path)
    options = StateDictOptions(ignore_frozen_params=True, strict=False) if trainable_only else None
    state = {"model": get_model_state_dict(model, options=options)}
    try:
        with _quiet_dcp_load():
            dcp.load(state, checkpoint_id=path, no_dist=_no_dist())
    except (Exception, CheckpointException) as exc:
        raise UserError(
            f"checkpoint {path}: reading the model shards (.metadata, __*.distcp) failed ({_last_line(exc)}); "
            "the files are damaged, or its config.toml names another model than the one it was trained on"
        ) from None
    set_model_state_dict(model, state["model"], options=options)
