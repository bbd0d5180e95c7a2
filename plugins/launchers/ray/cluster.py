"""The Ray side of a job's resources (docs/multinode.md, What the launcher does): connect, reserve
one STRICT_PACK placement group per node with a bundle per rank, order the ranks by node (IP,
then id: a node's ranks are contiguous, the order stable across restarts), find the rendezvous
address, and give everything back.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from minirl.errors import UserError


@dataclass(frozen=True)
class Shape:
    """What the job needs: nnodes groups of per_node bundles of `bundle` resources."""

    nnodes: int
    per_node: int
    use_gpu: bool

    @property
    def world(self) -> int:
        return self.nnodes * self.per_node

    @property
    def bundle(self) -> dict[str, float]:
        return {"GPU": 1.0, "CPU": 1.0} if self.use_gpu else {"CPU": 1.0}


@dataclass(frozen=True)
class Slot:
    """Where one rank runs: its placement group and bundle, its node, and its place on it."""

    rank: int
    node_rank: int
    local_rank: int
    local_world: int
    pg: object
    bundle: int
    node_id: str
    node_ip: str


def connect(address: str) -> bool:
    """ray.init unless this process is connected already; True when this call connected."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # every rank's lines, each with its own prefix
    if not sys.stdout.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # no colour codes in log files
    _check_reachable(address)
    try:
        ray.init(address=address or None, include_dashboard=False, log_to_driver=True, logging_level="WARNING")
    except ConnectionError as exc:
        raise UserError(
            f"cannot connect to the Ray cluster at {address!r} (trainer.ray_address, else RAY_ADDRESS, else 'auto' "
            f"for several nodes): {exc}; start one with `bash scripts/ray_cluster.sh head` (and `worker HEAD_IP` "
            "on the other nodes) and run the driver on the head, or set trainer.ray_address"
        ) from exc
    return True


def _check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """A HOST:PORT nobody answers on is an error now: ray.init would retry it for minutes."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return  # "auto", "", "local", ray://: Ray resolves these itself
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise UserError(
            f"trainer.ray_address / RAY_ADDRESS = {address!r}: nothing answers there ({exc}); start the head with "
            "`bash scripts/ray_cluster.sh head`, or fix the address (HEAD_IP:6379)"
        ) from exc


def reserve(shape: Shape, timeout_s: float) -> list:
    """One placement group per node, ready; a cluster too small fails after timeout_s, naming
    what the job needs and what the cluster has."""
    pgs = [placement_group([shape.bundle] * shape.per_node, strategy="STRICT_PACK") for _ in range(shape.nnodes)]
    try:
        ray.get([pg.ready() for pg in pgs], timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as exc:
        release(pgs)
        per = f"{shape.per_node} GPU + {shape.per_node} CPU" if shape.use_gpu else f"{shape.per_node} CPU"
        raise UserError(
            f"the Ray cluster could not place this job within trainer.ray_placement_timeout_s = {timeout_s:g}: "
            f"it needs {shape.nnodes} node(s) with {per} free on each (one placement group per node, STRICT_PACK); "
            f"the cluster has {seen_resources()}. Add nodes (scripts/ray_cluster.sh worker HEAD_IP), lower "
            "trainer.nnodes / n_gpus_per_node / world_size, or raise the timeout"
        ) from exc
    return pgs


def seen_resources() -> str:
    """The alive nodes with their GPU/CPU totals, and what is free now, for error messages."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    parts = [_describe(f"{n['NodeManagerAddress']} ({n['NodeID'][:8]}): ", n["Resources"]) for n in nodes]
    return f"{len(nodes)} alive node(s) [{'; '.join(parts)}], {_describe('free now ', ray.available_resources())}"


def _describe(prefix: str, resources: dict) -> str:
    return f"{prefix}{resources.get('GPU', 0):g} GPU, {resources.get('CPU', 0):g} CPU"


def slots(pgs: list) -> list[Slot]:
    """Ranks in node order: the ranks of one node are contiguous, rank 0 on the first node."""
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    bundles = sorted(
        (ips.get(node_id, ""), node_id, i, b)
        for i, pg in enumerate(pgs)
        for b, node_id in placement_group_table(pg)["bundles_to_node_id"].items()
    )
    node_ids = list(dict.fromkeys(node_id for _, node_id, _, _ in bundles))
    out = []
    for rank, (ip, node_id, i, b) in enumerate(bundles):
        on_node = [bundle for bundle in bundles if bundle[1] == node_id]
        local_rank = on_node.index((ip, node_id, i, b))
        out.append(Slot(rank, node_ids.index(node_id), local_rank, len(on_node), pgs[i], b, node_id, ip))
    return out


@ray.remote(num_cpus=0)
def _address() -> tuple[str, int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return ray.util.get_node_ip_address(), s.getsockname()[1]


def rendezvous(slot: Slot) -> tuple[str, int]:
    """(MASTER_ADDR, MASTER_PORT) from a task on rank 0's bundle: its node's IP and a free port."""
    strategy = PlacementGroupSchedulingStrategy(slot.pg, placement_group_bundle_index=slot.bundle)
    return ray.get(_address.options(scheduling_strategy=strategy).remote())


def release(pgs: list, actors: list = ()) -> None:
    """Kill the actors (they may sit in a collective) and remove the placement groups."""
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead, or its node is gone
            pass
    for pg in pgs:
        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001 - removed already
            pass
