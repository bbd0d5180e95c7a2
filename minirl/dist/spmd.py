"""The process group and the (dp, sp) mesh of one rank (minirl.dist.launchers start the ranks).

Every launcher (local, torchrun, ray) sets torchrun's variables (MASTER_ADDR/PORT, RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK), so every start runs `init_from_env`. One
process needs no workers: `single_process` gives it no process group on CPU and a one-rank group
and mesh on CUDA, so one GPU runs the same FSDP2 mixed-precision path as eight. Collectives time
out after trainer.collective_timeout_s: a rank that dies or hangs is an error on the others.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket

import torch
import torch.distributed as tdist

from minirl.dist.context import DistContext, resolve_device
from minirl.dist.link import Link


def build_mesh(device_type: str, world: int, sp: int):
    """The 2-D mesh (dp, sp): rank = dp_rank * sp + sp_rank, so an sp group is adjacent ranks
    (on one node: GPUs that share the fastest links carry the all-to-alls)."""
    from torch.distributed.device_mesh import init_device_mesh

    assert sp >= 1 and world % sp == 0, f"validation checks that sp {sp} divides the world {world}"
    return init_device_mesh(device_type, (world // sp, sp), mesh_dim_names=("dp", "sp"))


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_from_env(cfg, device_index: int | None = None) -> DistContext:
    """Join the process group that the environment describes (torchrun's variables) and build
    the mesh. One code path for every launcher. The CUDA device is cuda:LOCAL_RANK unless
    `device_index` says otherwise (Ray shows each rank only its own GPU, as cuda:0)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    return init_rank(cfg, rank, world, local_rank, "env://", device_index)


def init_rank(
    cfg, rank: int, world: int, local_rank: int, init_method: str, device_index: int | None = None
) -> DistContext:
    """Join the job. An asynchronous job's last cfg.rollout_world ranks are rollout ranks: they
    join only the link (minirl.dist.link); the others form the trainer's process group and mesh."""
    device = resolve_device(cfg.trainer.device, local_rank if device_index is None else device_index)
    timeout_s, rollout = cfg.trainer.collective_timeout_s, cfg.rollout_world
    if rank >= world - rollout:
        return _rollout_rank(device, rank - (world - rollout), rollout, timeout_s)
    world -= rollout
    init_process_group(device, timeout_s, init_method, rank, world)
    sp = cfg.actor.ulysses_sequence_parallel_size
    mesh = build_mesh(device.type, world, sp)
    ctx = DistContext(device=device, rank=rank, world_size=world, local_rank=local_rank, mesh=mesh, sp_size=sp)
    if rollout:
        ctx.role = "trainer"
        ctx.link = Link.connect(0, rollout, device, timeout_s) if rank == 0 else None
    return ctx


def _rollout_rank(device: torch.device, index: int, rollout: int, timeout_s: float) -> DistContext:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        set_cpu_threads()
    link = Link.connect(index + 1, rollout, device, timeout_s)
    return DistContext(device=device, role="rollout", link=link, rollout_rank=index)


def init_process_group(
    device: torch.device,
    timeout_s: float,
    init_method: str = "env://",
    rank: int = -1,
    world: int = -1,
) -> None:
    """gloo on CPU, NCCL on CUDA (one device per local rank); collectives time out."""
    kwargs = dict(timeout=datetime.timedelta(seconds=timeout_s), init_method=init_method, rank=rank, world_size=world)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # a timed-out NCCL collective tears the process down instead of blocking it forever
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        # gloo next to NCCL for collectives on CPU tensors: FSDP2 with CPU offload (gradient
        # norms of CPU shards) and small host-side reductions
        tdist.init_process_group("cuda:nccl,cpu:gloo", device_id=device, **kwargs)
    else:
        set_cpu_threads()
        tdist.init_process_group("gloo", **kwargs)


def single_process(cfg) -> DistContext:
    """One process: no process group on CPU; a one-rank group and mesh on CUDA (see module doc)."""
    device = resolve_device(cfg.trainer.device)
    if device.type != "cuda":
        set_cpu_threads()
        return DistContext(device=device)
    return init_rank(cfg, 0, 1, 0, f"tcp://127.0.0.1:{free_port()}")


def set_cpu_threads() -> None:
    """One intra-op thread per CPU process, unless OMP_NUM_THREADS says otherwise (torch read it
    when it was imported). torch's default, a thread per core, makes every op wait for its
    slowest thread: on a 2-core machine with other work running, the cpu profile took 14-22 s a
    step with the default and 3 s with one thread; the tiny CPU models gain little from more
    threads on an idle machine, and other work (a second run among it) may start at any time."""
    if not user_threads():
        torch.set_num_threads(1)


def user_threads() -> bool:
    return bool(os.environ.get("OMP_NUM_THREADS", "").strip())


def threads_note() -> str:
    """The start-up line's account of the intra-op threads (CPU)."""
    n, why = (
        torch.get_num_threads(),
        "OMP_NUM_THREADS" if user_threads() else "the default on CPU; OMP_NUM_THREADS=N sets it",
    )
    return f"{n} intra-op thread{'s' if n > 1 else ''} per process ({why})"


def shutdown() -> None:
    if tdist.is_initialized():
        tdist.destroy_process_group()


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct ports the OS calls free now: every socket stays bound until all n are chosen, so
    two calls in a row cannot hand out the same port (the OS may reuse a just-closed one)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
