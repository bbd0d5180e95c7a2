"""Process start on one node: the worker processes, the process group and the (dp, sp) mesh.

`launch(cfg, pm, job)` picks one of three starts (DESIGN.md §3):
- under torchrun (RANK and WORLD_SIZE in the environment) this process is one worker;
- with trainer.n_gpus_per_node (CUDA) or trainer.world_size (CPU) above 1 it spawns one worker
  per device and supervises them: the first worker that fails stops all the others, and its
  traceback (or its one-line user error) is printed once;
- otherwise the job runs in this process. On CUDA it still gets a one-rank process group and
  mesh, so one GPU runs the same FSDP2 mixed-precision path as eight.

Every collective times out after trainer.collective_timeout_s, so a rank that dies or hangs
turns into an error on the others instead of a hang. Spawned workers are told the same things
torchrun tells its workers (MASTER_ADDR/PORT, RANK, LOCAL_RANK, WORLD_SIZE), so from
`init_from_env` on, both starts run the same code.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as tdist

from minirl.dist import DistContext, resolve_device
from minirl.errors import Stopped, UserError

_STOP_GRACE_S = 5.0  # how long a stopped worker may take to exit before it is killed


# ---------------------------------------------------------------------------------------------
# the job's shape
# ---------------------------------------------------------------------------------------------


def job_world(cfg) -> tuple[str, int]:
    """(device type, number of worker processes) that the config asks for on this node."""
    t = cfg.trainer
    device = resolve_device(t.device).type
    if t.nnodes > 1:
        raise UserError(
            f"trainer.nnodes = {t.nnodes}: the built-in launcher starts the processes of one "
            "node; start several nodes with Ray (DESIGN.md §3) or torchrun on each node"
        )
    if device != "cuda":
        return device, t.world_size
    world = t.n_gpus_per_node
    if world > torch.cuda.device_count():
        raise UserError(
            f"trainer.n_gpus_per_node = {world}, but this machine has "
            f"{torch.cuda.device_count()} CUDA device(s); lower trainer.n_gpus_per_node"
        )
    return device, world


def check_layout(cfg, world: int) -> None:
    """The user errors of a (dp, sp) layout, each naming the key and the fix."""
    sp = cfg.actor.ulysses_sequence_parallel_size
    if sp < 1 or world % sp:
        raise UserError(
            f"actor.ulysses_sequence_parallel_size = {sp} does not divide the world size {world}; "
            f"use a divisor of {world}"
        )
    dp = world // sp
    for key, value in (
        ("data.train_batch_size", cfg.data.train_batch_size),
        ("actor.ppo_mini_batch_size", cfg.actor.ppo_mini_batch_size),
    ):
        if value % dp:
            raise UserError(
                f"{key} = {value} does not divide over {dp} data-parallel ranks (world {world} / "
                f"sp {sp}); data-parallel ranks take whole prompts, so use a multiple of {dp}"
            )
    ref_sp = cfg.ref.ulysses_sequence_parallel_size
    if ref_sp not in (1, sp):
        raise UserError(
            f"ref.ulysses_sequence_parallel_size = {ref_sp}: the reference runs on the actor's "
            f"mesh, so use 1 or the actor's {sp}"
        )


def build_mesh(device_type: str, world: int, sp: int):
    """The 2-D mesh (dp, sp): rank = dp_rank * sp + sp_rank, so an sp group is adjacent ranks
    (on one node: GPUs that share the fastest links carry the all-to-alls)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (world // sp, sp), mesh_dim_names=("dp", "sp"))


# ---------------------------------------------------------------------------------------------
# inside a worker
# ---------------------------------------------------------------------------------------------


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_from_env(cfg) -> DistContext:
    """Join the process group that the environment describes (torchrun's variables) and build
    the mesh. One code path for torchrun and for the workers `spawn` starts."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return init_rank(cfg, rank, world, local_rank, local_world, "env://")


def init_rank(cfg, rank: int, world: int, local_rank: int, local_world: int, init_method: str) -> DistContext:
    device = resolve_device(cfg.trainer.device, local_rank)
    check_layout(cfg, world)
    init_process_group(device, cfg.trainer.collective_timeout_s, local_world, init_method, rank, world)
    sp = cfg.actor.ulysses_sequence_parallel_size
    mesh = build_mesh(device.type, world, sp)
    return DistContext(device=device, rank=rank, world_size=world, local_rank=local_rank, mesh=mesh, sp_size=sp)


def init_process_group(
    device: torch.device,
    timeout_s: float,
    local_world: int = 1,
    init_method: str = "env://",
    rank: int = -1,
    world: int = -1,
) -> None:
    """gloo on CPU, NCCL on CUDA (one device per local rank); collectives time out."""
    kwargs = {
        "timeout": datetime.timedelta(seconds=timeout_s),
        "init_method": init_method,
        "rank": rank,
        "world_size": world,
    }
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # a timed-out NCCL collective tears the process down instead of blocking it forever
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        # gloo next to NCCL for collectives on CPU tensors: FSDP2 with CPU offload (gradient
        # norms of CPU shards) and small host-side reductions
        tdist.init_process_group("cuda:nccl,cpu:gloo", device_id=device, **kwargs)
    else:
        # 2 processes on 2 cores: one intra-op thread each, or they fight over the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        tdist.init_process_group("gloo", **kwargs)


def single_process(cfg) -> DistContext:
    """One process: no process group on CPU; a one-rank group and mesh on CUDA (see module doc)."""
    device = resolve_device(cfg.trainer.device)
    if device.type != "cuda":
        return DistContext(device=device)
    return init_rank(cfg, 0, 1, 0, 1, f"tcp://127.0.0.1:{free_port()}")


def load_model_for_rank(model_cfg, dist: DistContext, dtype: torch.dtype):
    """(model, tokenizer) as this rank should hold them before sharding.

    A checkpoint (model.path) is read by rank 0 alone; the other ranks build the model on the
    meta device (no memory, no disk reads) and the FSDP2 plugin fills their shards from rank 0's
    weights (broadcast_from_rank0). Random presets are drawn on every rank: seeded, and cheaper
    than a broadcast.
    """
    from minirl.models.loading import load_model

    if dist.world_size == 1 or dist.rank == 0 or not model_cfg.path:
        return load_model(model_cfg, dist.device, dtype)
    from transformers import AutoConfig, AutoModelForCausalLM

    from minirl.models.attention import ATTN_NAME, register_attention
    from minirl.models.tokenizers import load_tokenizer

    register_attention()
    config = AutoConfig.from_pretrained(model_cfg.path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=model_cfg.attn_implementation or ATTN_NAME, dtype=dtype
        )
    return model.eval(), load_tokenizer(model_cfg)


def shutdown() -> None:
    if tdist.is_initialized():
        tdist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# starting workers and watching them
# ---------------------------------------------------------------------------------------------


def launch(cfg, pm, job: Callable[[Any, Any, DistContext], Any]) -> int:
    """Run job(cfg, pm, dist) on every rank; returns the exit status (0, 1 crash, 2 user error).

    Spawned workers rebuild the plugin manager from cfg.plugins.modules (pluggy managers do not
    pickle); in-place runs use `pm`.
    """
    if under_torchrun():
        return run_in_place(cfg, pm, job, lambda: init_from_env(cfg))
    _, world = job_world(cfg)
    if world > 1:
        check_layout(cfg, world)  # fail once, here, rather than once per worker
        return spawn(_job_entry, world, (cfg, job))
    return run_in_place(cfg, pm, job, lambda: single_process(cfg))


def run_in_place(cfg, pm, job, make_dist: Callable[[], DistContext]) -> int:
    try:
        dist = make_dist()
        job(cfg, pm, dist)
    except UserError as exc:
        prefix = f"(rank {os.environ['RANK']}) " if under_torchrun() else ""
        print(f"minirl: error: {prefix}{exc}", file=sys.stderr)
        return 2
    except Stopped as exc:
        if not under_torchrun() or os.environ["RANK"] == "0":
            print(f"minirl: {exc}", file=sys.stderr)
        return exc.exit_code
    finally:
        shutdown()
    return 0


def _job_entry(rank: int, cfg, job) -> None:
    from minirl.plugins import PluginManager

    dist = init_from_env(cfg)
    try:
        job(cfg, PluginManager(cfg.plugins.modules), dist)
    finally:
        shutdown()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn: Callable[..., Any], world: int, args: tuple = (), env: dict[str, str] | None = None) -> int:
    """Run fn(rank, *args) in `world` fresh processes that form one process group's environment.

    Returns 0 when all succeed. When one fails, the others are stopped, its error is printed
    (a UserError as one line, anything else with its traceback) and the status is 2 or 1.
    fn and args must pickle (a module-level function; a frozen config does).
    """
    ctx = multiprocessing.get_context("spawn")  # fork would copy CUDA and thread state
    # errors travel through files: a pipe could fill up with a long traceback and block the
    # worker's exit, which is what the supervisor waits for
    error_dir = tempfile.mkdtemp(prefix="minirl-errors-")
    base_env = dict(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        **(env or {}),
    )
    procs = [
        ctx.Process(
            target=_worker_main, args=(fn, rank, args, base_env, error_dir, os.getpid()), name=f"minirl-rank{rank}"
        )
        for rank in range(world)
    ]
    try:
        for p in procs:
            p.start()
        with _ForwardSignals(procs):
            failed = _wait_first_failure(procs)
        _stop(procs)  # the others may be blocked in a collective with the failed rank
        return 0 if failed is None else _report(procs.index(failed), failed.exitcode, error_dir)
    finally:
        _stop(procs)
        shutil.rmtree(error_dir, ignore_errors=True)


def _worker_main(fn, rank: int, args: tuple, env: dict[str, str], error_dir: str, parent_pid: int) -> None:
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    try:
        fn(rank, *args)
    except UserError as exc:
        _write_error(error_dir, rank, "user", str(exc))
        sys.exit(2)
    except Stopped as exc:
        _write_error(error_dir, rank, "stopped", str(exc))
        sys.exit(exc.exit_code)
    except BaseException:  # noqa: BLE001 - report everything, the parent decides what to show
        _write_error(error_dir, rank, "crash", traceback.format_exc())
        sys.exit(1)


def _write_error(error_dir: str, rank: int, kind: str, text: str) -> None:
    path = os.path.join(error_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"kind": kind, "text": text, "time": time.time()}, f)
    os.replace(path + ".tmp", path)  # the supervisor never reads half a report


def _exit_with_parent(parent_pid: int) -> None:
    """A worker whose supervisor died (kill -9) must not live on holding a GPU."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


class _ForwardSignals:
    """The supervisor passes SIGTERM/SIGINT on: the first as SIGTERM (workers finish the step and
    checkpoint), a second as SIGKILL. Kubernetes signals only the container's first process, so
    the workers would otherwise never hear of it."""

    def __init__(self, procs: list):
        self.procs, self.count, self.previous = procs, 0, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._forward)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _forward(self, signum, frame) -> None:
        self.count += 1
        for p in self.procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM if self.count == 1 else signal.SIGKILL)


_STOP_CODES = (128 + signal.SIGTERM, 128 + signal.SIGINT)


def _wait_first_failure(procs: list):
    """Wait until every worker exits 0 (returns None) or one fails (returns it). A worker that
    stopped on a signal after checkpointing (exit 128 + signal) is not a failure: the others are
    finishing the same checkpoint, so they are waited for, and the first such worker is returned."""
    running, stopped = {p.sentinel: p for p in procs}, None
    while running:
        for sentinel in multiprocessing.connection.wait(list(running)):
            p = running.pop(sentinel)
            p.join()
            if p.exitcode in _STOP_CODES:
                stopped = stopped or p
            elif p.exitcode != 0:
                return p
    return stopped


def _report(rank: int, exitcode: int, error_dir: str) -> int:
    """Print the failed worker's error (or the earliest report, if it left none) once."""
    reports = {}
    for name in os.listdir(error_dir):
        if name.endswith(".json"):
            with open(os.path.join(error_dir, name)) as f:
                reports[int(name[4:-5])] = json.load(f)
    if rank not in reports and reports:
        rank = min(reports, key=lambda r: reports[r]["time"])
    if rank not in reports:  # killed by a signal (the OOM killer, say): nothing was written
        print(f"minirl: worker rank {rank} died with exit code {exitcode}; all workers stopped", file=sys.stderr)
        return 1
    kind, text = reports[rank]["kind"], reports[rank]["text"]
    if kind == "stopped":
        print(f"minirl: {text}", file=sys.stderr)
        return exitcode
    if kind == "user":
        print(f"minirl: error: (rank {rank}) {text}", file=sys.stderr)
        return 2
    print(
        f"minirl: worker rank {rank} failed; all workers stopped. Its traceback:\n{text}", file=sys.stderr, flush=True
    )
    return 1


def _stop(procs: list) -> None:
    procs = [p for p in procs if p.pid is not None]  # started ones only
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + _STOP_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
