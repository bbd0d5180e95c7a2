"""The ray launcher's driver (docs/multinode.md): reserve the cluster, start one actor per rank,
watch them. The first rank that fails is reported once, every other actor is killed (they are
stuck in a collective with it) and the placement groups are removed. SIGTERM/SIGINT to the
driver reach every rank as SIGTERM (each finishes its step and checkpoints); a second kills all.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from minirl.dist import spmd
from minirl.dist.launchers import EXIT_CRASH, Report, print_report, ray_address, report_of
from minirl.dist.signals import SignalHandler
from minirl.errors import UserError
from minirl.plugins import PluginManager
from minirl.validate.core import check_world
from minirl_plugins.launchers.ray import cluster

PEER_GRACE_S = 5.0  # a collective that lost its peer waits this long for the peer's own report
POLL_S = 0.5  # how often the watch loop looks at signals
LOG_FLUSH_S = 1.0  # the ranks' last lines travel to the driver after their results
FORWARDED_ENV = ("PYTHONPATH",)  # and every MINIRL_* variable: the driver's, for every rank


class RankActor:
    """The actor one rank lives in. Its runtime_env sets torchrun's variables before torch starts,
    so `run` goes through `init_from_env` like every other launcher. A plain synchronous actor on
    purpose: `run` executes on the main thread, where the trainer's SIGTERM/SIGINT handler can be
    installed."""

    def __repr__(self) -> str:
        # Ray prefixes the lines this actor prints with its repr: "(rank3 pid=..., ip=...)"
        return f"rank{os.environ.get('RANK', '?')}"

    def pid(self) -> int:
        return os.getpid()

    def run(self, cfg, job, cwd: str) -> Report | None:
        """Run job on this rank; None when it finished, else its report (never raises)."""
        if os.path.isdir(cwd):
            os.chdir(cwd)  # relative paths of the config mean what they mean on the driver
        try:
            dist = spmd.init_from_env(cfg, _device_index())
            job(cfg, PluginManager(cfg.plugins.modules), dist)
            return None
        except BaseException as exc:  # noqa: BLE001 - every end is reported, the driver decides
            return report_of(exc)
        finally:
            spmd.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()


def _device_index() -> int | None:
    """This rank's CUDA device: Ray shows an actor only its own GPU (cuda:0), unless the cluster
    runs with RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES, when it is the GPU Ray assigned."""
    gpus = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
    if not gpus:
        return None
    return int(gpus[0]) if os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES") else 0


@dataclass
class Rank:
    slot: cluster.Slot
    actor: object
    pid: int = 0


def launch(cfg, pm, job) -> int:
    t = cfg.trainer
    # several nodes need a running cluster ("auto": the one this machine belongs to); one node
    # without an address gets a Ray instance of its own
    owned = cluster.connect(ray_address(t) or ("auto" if t.nnodes > 1 else ""))
    pgs, ranks = [], []
    try:
        shape = job_shape(cfg)
        check_world(cfg, pm, shape.world)  # with trainer.device = 'auto' the world is the cluster's GPUs
        pgs = cluster.reserve(shape, t.ray_placement_timeout_s)
        ranks = start(cluster.slots(pgs), shape.use_gpu)
        return watch(ranks, cfg, job)
    finally:
        cluster.release(pgs, [r.actor for r in ranks])
        if owned:
            time.sleep(LOG_FLUSH_S)
            ray.shutdown()


def job_shape(cfg) -> cluster.Shape:
    """GPU bundles for trainer.device = cuda (or auto on a cluster with GPUs), else CPU workers:
    trainer.world_size in all, split evenly over the nodes."""
    t = cfg.trainer
    gpus = ray.cluster_resources().get("GPU", 0)
    if t.device == "cuda" or (t.device == "auto" and gpus > 0):
        return _gpu_shape(cfg)
    return cluster.Shape(t.nnodes, t.world_size // t.nnodes, use_gpu=False)


def _gpu_shape(cfg) -> cluster.Shape:
    """The trainer's nodes, then an asynchronous job's rollout nodes (its last ranks): one node
    holds both groups, or each group has nodes of its own with as many GPUs each."""
    t, r = cfg.trainer, cfg.rollout
    if not cfg.async_training.enable:
        return cluster.Shape(t.nnodes, t.n_gpus_per_node, use_gpu=True)
    if t.nnodes == 1 and r.nnodes == 1:
        return cluster.Shape(1, t.n_gpus_per_node + r.n_gpus_per_node, use_gpu=True)
    if t.n_gpus_per_node != r.n_gpus_per_node:
        raise UserError(
            f"rollout.n_gpus_per_node = {r.n_gpus_per_node}: on several nodes the ray launcher gives the trainer "
            f"and the rollout nodes of their own with the same GPUs each (trainer.n_gpus_per_node = "
            f"{t.n_gpus_per_node}); make them equal, or put both groups on one node"
        )
    return cluster.Shape(t.nnodes + r.nnodes, t.n_gpus_per_node, use_gpu=True)


def start(slots: list[cluster.Slot], use_gpu: bool) -> list[Rank]:
    """One actor per slot, each told its rank before torch starts (runtime_env)."""
    addr, port = cluster.rendezvous(slots[0])
    base = {k: v for k, v in os.environ.items() if k in FORWARDED_ENV or k.startswith("MINIRL_")}
    base.update(MASTER_ADDR=addr, MASTER_PORT=str(port), WORLD_SIZE=str(len(slots)))
    actor_class = ray.remote(RankActor)
    ranks = []
    for s in slots:
        env = dict(
            base, RANK=str(s.rank), LOCAL_RANK=str(s.local_rank), LOCAL_WORLD_SIZE=str(s.local_world),
            NODE_RANK=str(s.node_rank),
        )  # fmt: skip
        actor = actor_class.options(
            num_cpus=1,
            num_gpus=1 if use_gpu else 0,
            max_restarts=0,  # a restarted rank could not rejoin the process group
            scheduling_strategy=PlacementGroupSchedulingStrategy(s.pg, placement_group_bundle_index=s.bundle),
            runtime_env={"env_vars": env},
        ).remote()
        ranks.append(Rank(s, actor))
    return ranks


def watch(ranks: list[Rank], cfg, job) -> int:
    """Run job on every rank; the exit status, after printing the first failure once."""
    failed = _learn_pids(ranks)
    if failed:
        return print_report(*failed)
    refs = {r.actor.run.remote(cfg, job, os.getcwd()): r for r in ranks}
    with _StopSignals() as stop:
        rank, report = _first_failure(refs, stop)
    return 0 if report is None else print_report(rank, report)


def _learn_pids(ranks: list[Rank]) -> tuple[int, Report] | None:
    """Each actor's pid (for forwarding signals); an actor that could not start is a failure."""
    refs = {r.actor.pid.remote(): r for r in ranks}
    for ref, r in refs.items():
        try:
            r.pid = ray.get(ref)
        except ray.exceptions.RayError as exc:
            return r.slot.rank, _died(r, exc)
    return None


def _first_failure(refs: dict, stop: _StopSignals) -> tuple[int, Report | None]:
    """(rank, report) of the failure to show, of a stop, or (-1, None) when every rank finished.

    A rank whose collective lost its peer is a consequence: the loop waits up to PEER_GRACE_S
    for the report of the rank that caused it (an actor death is noticed a moment later)."""
    pending, failures, causes, stopped, first_at = dict(refs), [], [], None, None
    while pending:
        if stop.kill_now:
            return -1, Report("stopped", f"second {stop.name}: every rank killed", 128 + stop.signum)
        stop.forward(list(pending.values()))
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
        for ref in ready:
            r = pending.pop(ref)
            report = _outcome(ref, r, stop)
            if report is None:
                continue
            if report.kind == "stopped":
                stopped = stopped or (r.slot.rank, report)
                continue
            failures.append((r.slot.rank, report))
            first_at = first_at or time.monotonic()
        causes = [f for f in failures if f[1].kind != "peer"]
        if causes or (failures and time.monotonic() - first_at > PEER_GRACE_S):
            break
    return (causes or failures or [stopped or (-1, None)])[0]


def _outcome(ref, r: Rank, stop: _StopSignals) -> Report | None:
    try:
        return ray.get(ref)
    except ray.exceptions.RayError as exc:
        if stop.signum:  # a rank that got the second signal exits at once (minirl.dist.signals)
            return Report("stopped", f"stopped by {stop.name}", 128 + stop.signum)
        return _died(r, exc)


def _died(r: Rank, exc: BaseException) -> Report:
    """A rank without a report: its actor, process or node died (the reason Ray gives)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    because = [line for line in lines if "because" in line or "exit detail" in line.lower()]
    reason = (because or lines or [type(exc).__name__])[0]
    return Report("died", f"{reason} (node {r.slot.node_ip}, {type(exc).__name__})", EXIT_CRASH)


@ray.remote(num_cpus=0)
def _send_signal(pid: int, signum: int) -> None:
    os.kill(pid, signum)


class _StopSignals(SignalHandler):
    """SIGTERM/SIGINT to the driver: the first reaches every rank as SIGTERM (by a task on the
    rank's node, which may be another machine), the second kills every actor. The handler only
    sets flags: the Ray calls wait for the watch loop."""

    def __init__(self):
        super().__init__()
        self.sent = False

    @property
    def kill_now(self) -> bool:
        return self.count > 1

    def _request(self, signum: int) -> None:
        if self.count == 1:
            print(f"minirl: got {self.name}: every rank finishes its step and checkpoints", file=sys.stderr, flush=True)

    def forward(self, ranks: list[Rank]) -> None:
        if not self.signum or self.sent:
            return
        self.sent = True
        for r in ranks:
            strategy = NodeAffinitySchedulingStrategy(r.slot.node_id, soft=False)
            _send_signal.options(scheduling_strategy=strategy).remote(r.pid, signal.SIGTERM)
