"""The ray launcher on a Ray cluster of this machine: two nodes faked with
ray.cluster_utils.Cluster (2 nodes x 2 CPUs, gloo). It must run the same job as the local
launcher, order ranks by node, and end every failure (a user error, a vanished process, a lost
node, a cluster too small) with one clear line, a non-zero status and nothing left behind.

Ray is a test dependency (the `ray` extra, installed by `make test` (make install-test)): without it this file
fails to import, which fails CI instead of skipping. The node-removal test runs last: it
replaces the worker node it removes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import dist_helpers as h
import pytest
import ray
import ray_jobs
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group_table

from minirl.dist import launchers
from minirl.errors import UserError
from minirl.plugins import PluginManager

pytestmark = pytest.mark.distributed
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    c.add_node(num_cpus=2)
    ray.init(address=c.address, logging_level="WARNING")
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture
def out(tmp_path, monkeypatch):
    """The jobs' output directory, and this directory on the actors' PYTHONPATH (forwarded)."""
    monkeypatch.setenv("MINIRL_TEST_OUT", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    return tmp_path


def _launch(job, *overrides: str) -> int:
    cfg = h.config("data.train_batch_size=4", "actor.ppo_mini_batch_size=4", *overrides)
    return launchers.launch(cfg, PluginManager(entry_points=False), job)


def _nothing_left(timeout_s: float = 20.0) -> None:
    """Every actor dead and every placement group removed (ray's own tables)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [a for a in ray._private.state.actors().values() if a["State"] != "DEAD"]
        pgs = [p for p in placement_group_table().values() if p["state"] != "REMOVED"]
        if not alive and not pgs:
            return
        assert time.monotonic() < deadline, f"left behind: {len(alive)} actor(s), {len(pgs)} placement group(s)"
        time.sleep(0.5)


def test_two_nodes_give_contiguous_ranks_per_node(cluster, out):
    """trainer.nnodes = 2 picks the ray launcher: 4 ranks, two per node, NODE_RANK and
    LOCAL_RANK as torchrun would set them, and the job (one all-reduce) completes."""
    assert _launch(ray_jobs.record, "trainer.nnodes=2", "trainer.world_size=4") == 0
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    for r, s in enumerate(seen):
        assert (int(s["NODE_RANK"]), int(s["LOCAL_RANK"])) == (r // 2, r % 2)
        assert (s["WORLD_SIZE"], s["LOCAL_WORLD_SIZE"], s["world"], s["rank_sum"]) == ("4", "2", 4, 6.0)
    nodes = [s["node_id"] for s in seen]
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2]
    _nothing_left()


def test_a_user_error_on_a_rank_is_one_line(cluster, out, capfd):
    """Rank 1's UserError while rank 0 waits in a collective: one line naming the rank, exit 2,
    rank 0 killed at once (not after the collective timeout)."""
    start = time.monotonic()
    # a 900 s collective timeout: the job must end long before it (a loaded 2-core CI machine
    # takes up to a minute to start two Ray workers, so the bound is generous but far below it)
    rc = _launch(
        ray_jobs.user_error_on_rank1, "trainer.nnodes=2", "trainer.world_size=2", "trainer.collective_timeout_s=900"
    )
    err = capfd.readouterr().err
    assert rc == 2 and time.monotonic() - start < 300
    assert err.count("minirl: error: (rank 1) data.train_files = []") == 1 and "Traceback" not in err
    _nothing_left()


def test_a_rank_whose_process_exits_is_reported_once(cluster, out, capfd):
    """os._exit(1) on rank 1 leaves no report; rank 0's collective then fails on the lost peer.
    The error names rank 1 (the cause), once, and the driver exits 1."""
    rc = _launch(ray_jobs.exit_on_rank1, "trainer.nnodes=2", "trainer.world_size=2")
    err = capfd.readouterr().err
    assert rc == 1
    assert err.count("minirl: worker rank") == 1 and "minirl: worker rank 1 died" in err
    _nothing_left()


def test_a_cluster_too_small_fails_within_the_timeout(cluster, out):
    """4 CPU workers on one node, on a cluster of two 2-CPU nodes (4 CPUs in all, but a node's
    ranks are packed on it): a user error after trainer.ray_placement_timeout_s, naming what
    was needed and what the cluster has."""
    start = time.monotonic()
    with pytest.raises(UserError, match=r"needs 1 node\(s\) with 4 CPU free on each.*has 2 alive node\(s\)"):
        _launch(ray_jobs.record, "trainer.launcher='ray'", "trainer.world_size=4", "trainer.ray_placement_timeout_s=3")
    assert time.monotonic() - start < 120  # 3 s of placement timeout plus Ray's own start-up, loaded
    _nothing_left()


def _metrics(run_dir: Path) -> list[dict]:
    """Per-step metrics without the wall-clock ones (timings, throughputs)."""
    rows = [json.loads(line) for line in (run_dir / "bench" / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in m.items() if not k.startswith("timing_s/") and "throughput" not in k} for m in rows]


def test_cpu_profile_under_ray_matches_the_local_launcher(cluster, tmp_path, data_dir):
    """The same 2-rank job (cpu profile, same seed) under the local launcher and under Ray:
    exactly the same metrics, every rank's lines prefixed, the metric table printed once."""
    local = h.run_cli(tmp_path / "local", data_dir, "trainer.total_training_steps=2", "trainer.launcher='local'")
    assert local.returncode == 0, local.stderr[-3000:]
    under_ray = h.run_cli(
        tmp_path / "ray", data_dir, "trainer.total_training_steps=2", f"trainer.ray_address='{cluster.address}'"
    )
    assert under_ray.returncode == 0, under_ray.stderr[-3000:]
    assert _metrics(tmp_path / "ray") == _metrics(tmp_path / "local")
    assert under_ray.stdout.count("step throughput") == 1
    assert "(rank0 pid=" in under_ray.stdout and "world 2 (dp 2, sp 1)" in under_ray.stdout
    _nothing_left()


def test_sigterm_to_the_driver_checkpoints_every_rank(cluster, tmp_path, data_dir):
    """SIGTERM to the driver reaches every rank (a task on its node signals it): the ranks
    finish the step and checkpoint, and the driver prints the one line and exits 143."""
    args = [sys.executable, "-m", "minirl", "--config", str(h.ROOT / "bench.toml"), "--profile", "cpu"]
    args += [
        f'data.train_files=["{data_dir}/copy/train.parquet"]',
        f"trainer.default_local_dir={tmp_path}",
        *("trainer.progress_bar=false", "trainer.val_before_train=false", "trainer.test_freq=-1"),
        *("trainer.world_size=2", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "rollout.n=2"),
        *("trainer.total_training_steps=500", f"trainer.ray_address='{cluster.address}'"),
    ]
    proc = subprocess.Popen(args, cwd=h.ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "bench" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().strip()) and proc.poll() is None:
        assert time.monotonic() < deadline, "no step finished within 120 s"
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert err.count("minirl: stopped by SIGTERM after step") == 1
    assert list((tmp_path / "bench").glob("ckpt_*"))
    _nothing_left()


def test_a_removed_node_stops_the_job(cluster, out, capfd):
    """The node of one rank goes away mid-job: the driver names that rank, exits 1, kills the
    survivor and removes the placement groups. (Last: it replaces the node it removes.)"""
    result = {}
    driver = threading.Thread(
        target=lambda: result.update(rc=_launch(ray_jobs.wait_forever, "trainer.nnodes=2", "trainer.world_size=2"))
    )
    driver.start()
    deadline = time.monotonic() + 60
    while len(list(out.glob("rank*.json"))) < 2:
        assert time.monotonic() < deadline and driver.is_alive(), "the ranks did not start"
        time.sleep(0.2)
    worker = cluster.worker_nodes and next(iter(cluster.worker_nodes))
    node_rank = {json.loads(p.read_text())["node_id"]: p.stem for p in out.glob("rank*.json")}[worker.node_id]
    try:
        cluster.remove_node(worker)
        driver.join(60)
        assert not driver.is_alive() and result["rc"] == 1
        err = capfd.readouterr().err
        assert err.count("minirl: worker rank") == 1 and f"minirl: worker rank {node_rank[4:]} died" in err
        assert "node has died" in err
        _nothing_left()
    finally:
        cluster.add_node(num_cpus=2)


def test_async_job_under_ray_matches_the_local_launcher(cluster, tmp_path, data_dir):
    """An asynchronous job (2 trainer ranks + 2 rollout ranks, on-policy: staleness 0) under Ray
    on two nodes (the trainer's on one, the rollout's on the other) gives exactly the local
    launcher's metrics on one machine, the timing-dependent ones aside."""
    job = [
        "trainer.total_training_steps=3",
        "trainer.world_size=4",
        "rollout.n_gpus_per_node=2",
        "async_training.enable=true",
        "async_training.require_batches=2",
        "async_training.staleness_threshold=0",
    ]
    local = h.run_cli(tmp_path / "local", data_dir, *job, "trainer.launcher='local'")
    assert local.returncode == 0, local.stderr[-3000:]
    under_ray = h.run_cli(
        tmp_path / "ray", data_dir, *job, "trainer.nnodes=2", f"trainer.ray_address='{cluster.address}'"
    )
    assert under_ray.returncode == 0, under_ray.stderr[-3000:]

    def deterministic(run_dir):
        timing = ("async/rollout_idle_s", "async/trainer_idle_s", "async/queue_depth")
        return [{k: v for k, v in m.items() if k not in timing} for m in _metrics(run_dir)]

    assert deterministic(tmp_path / "ray") == deterministic(tmp_path / "local")
    assert [m["async/batch_index"] for m in _metrics(tmp_path / "ray")] == [0, 1, 2]
    _nothing_left()
