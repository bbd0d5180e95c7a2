"""Process start: spawned workers form a process group and a (dp, sp) mesh, and a failing or
hung worker stops the whole job with its error instead of hanging it."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import dist_helpers as h
import pytest
import torch
import torch.distributed as tdist

from minirl.config.load import load_config
from minirl.dist import spmd
from minirl.dist.launchers import spawn
from minirl.errors import UserError
from minirl.forward.packed import response_logprobs
from minirl.models import assembly
from minirl.plugins import PluginManager

pytestmark = pytest.mark.distributed


def _cfg(*overrides: str):
    return load_config(None, ["trainer.device='cpu'", *overrides])


def _mesh_worker(rank: int, cfg) -> None:
    dist = spmd.init_from_env(cfg)
    try:
        assert (dist.rank, dist.world_size, dist.sp_size, dist.dp_size) == (rank, 2, 2, 1)
        assert dist.mesh.mesh_dim_names == ("dp", "sp") and dist.dp_rank == 0
        x = dist.all_reduce(torch.tensor([float(rank + 1)]))  # over dp: only this rank
        assert x.item() == rank + 1
        total = torch.tensor([float(rank + 1)])
        tdist.all_reduce(total)
        assert total.item() == 3.0
    finally:
        spmd.shutdown()


def test_spawned_workers_build_the_dp_sp_mesh():
    """world 2, sp 2: one dp group of one rank each, one sp group of both; reductions agree."""
    cfg = _cfg(
        "trainer.world_size=2",
        "actor.ulysses_sequence_parallel_size=2",
        "data.train_batch_size=2",
        "actor.ppo_mini_batch_size=2",
    )
    assert spawn.spawn(_mesh_worker, 2, (cfg,)) == 0


def _crash_worker(rank: int, timeout_s: float) -> None:
    spmd.init_process_group(torch.device("cpu"), timeout_s)
    if rank == 1:
        raise RuntimeError("boom from rank 1")
    tdist.all_reduce(torch.ones(1))  # rank 0 waits here for a peer that will never come


def test_a_failing_worker_stops_all_with_its_traceback(capfd):
    """Rank 1 raises while rank 0 sits in a collective with a long timeout: the supervisor
    must stop rank 0 at once and print rank 1's traceback, not wait for the timeout."""
    start = time.monotonic()
    rc = spawn.spawn(_crash_worker, 2, (300.0,))
    elapsed = time.monotonic() - start
    err = capfd.readouterr().err
    assert rc == 1
    assert elapsed < 60, f"took {elapsed:.0f}s: the supervisor waited for the collective timeout"
    assert "worker rank 1 failed" in err and "RuntimeError: boom from rank 1" in err
    assert "Traceback" in err


def _hang_worker(rank: int, timeout_s: float) -> None:
    spmd.init_process_group(torch.device("cpu"), timeout_s)
    if rank == 1:
        time.sleep(3600)  # alive but never joins the collective
    tdist.all_reduce(torch.ones(1))


def test_a_hung_worker_times_out_instead_of_hanging(capfd):
    """A rank that stops answering makes the others' collectives time out
    (trainer.collective_timeout_s), which ends the job with an error."""
    start = time.monotonic()
    rc = spawn.spawn(_hang_worker, 2, (3.0,))
    elapsed = time.monotonic() - start
    err = capfd.readouterr().err
    assert rc == 1 and elapsed < 60
    assert "worker rank 0 failed" in err


def _signal_worker(rank: int, timeout_s: float, signum: int) -> None:
    spmd.init_process_group(torch.device("cpu"), timeout_s)
    tdist.all_reduce(torch.ones(1))  # both ranks are in the group
    if rank == 1:
        os.kill(os.getpid(), signum)
    tdist.all_reduce(torch.ones(1))  # rank 0 waits here for rank 1


@pytest.mark.parametrize(
    "signum, timeout_s, named",
    [
        (signal.SIGKILL, 300.0, "worker rank 1 died: killed by SIGKILL; all workers stopped"),
        (signal.SIGSTOP, 3.0, "worker rank 1 died: stopped by a signal (SIGSTOP or SIGTSTP: process state T)"),
    ],
)
def test_a_killed_or_stopped_rank_in_a_collective_is_named(capfd, signum, timeout_s, named):
    """kill -9 of rank 1 while rank 0 waits in a collective stops the job at once (not after the
    300 s timeout) naming rank 1 and its signal, even when rank 0's lost-peer error arrives
    first; a SIGSTOPped rank 1 stops it after the collective timeout, named as the hung rank
    (rank 0's timeout is the consequence). Either way no worker is left."""
    start = time.monotonic()
    rc = spawn.spawn(_signal_worker, 2, (timeout_s, signum))
    elapsed = time.monotonic() - start
    err = capfd.readouterr().err
    assert rc == 1 and elapsed < min(timeout_s, 30) + 20, (elapsed, err)
    assert named in err and err.count("minirl:") == 1, err
    assert not multiprocessing.active_children()


class _AbortsAtTeardown:
    """Stands for a C++ object that aborts when the interpreter's teardown frees it (a gloo
    thread freeing a tensor that needs the GIL: "terminate called without an active exception")."""

    def __del__(self):
        os.abort()


def _finished_worker(rank: int, marker: str) -> None:
    import atexit
    import sys
    import types

    held = sys.modules["_minirl_left_behind"] = types.ModuleType("_minirl_left_behind")
    held.obj = _AbortsAtTeardown()  # freed when the teardown clears sys.modules
    atexit.register(lambda: open(f"{marker}.{rank}", "w").close())


def test_a_finished_worker_runs_its_atexit_handlers_and_skips_the_teardown(tmp_path):
    """A rank whose job is done exits 0 without the interpreter teardown that could abort it
    (seen in CI after a finished run), and its atexit handlers (trackers' uploads) still run."""
    marker = str(tmp_path / "atexit")
    assert spawn.spawn(_finished_worker, 2, (marker,)) == 0
    assert os.path.exists(f"{marker}.0") and os.path.exists(f"{marker}.1")


def _user_error_worker(rank: int) -> None:
    raise UserError("data.train_files = []: list one or more parquet files")


def test_a_user_error_in_a_worker_is_one_line(tmp_path, capfd, monkeypatch):
    """User mistakes print as `minirl: error:` with the rank, exit status 2, no traceback.
    (The worker side runs in this process: what matters is what it reports and how.)"""
    for name in ("RANK", "LOCAL_RANK"):  # the worker sets them; restore them afterwards
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        spawn._worker_main(_user_error_worker, 1, (), {}, str(tmp_path), os.getppid())
    assert exit_info.value.code == 2
    assert spawn._report(1, 2, str(tmp_path)) == 2
    err = capfd.readouterr().err
    assert "minirl: error: (rank 1) data.train_files = []" in err and "Traceback" not in err


def test_torchrun_environment_is_detected(monkeypatch):
    """Under torchrun the CLI must not spawn workers of its own."""
    monkeypatch.delenv("RANK", raising=False)
    assert not spmd.under_torchrun()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert spmd.under_torchrun()


def test_one_rank_group_runs_the_sharded_path(monkeypatch):
    """One GPU runs as a one-rank group with a mesh (so FSDP2's mixed precision applies as on
    eight); here the same on CPU/gloo, in this process: FSDP2 at world 1 trains like no FSDP."""
    cfg = _cfg("data.train_batch_size=1", "actor.ppo_mini_batch_size=1", "actor.optim.eps=1e-4")
    dist = spmd.init_rank(cfg, 0, 1, 0, f"tcp://127.0.0.1:{spmd.free_port()}")
    try:
        assert dist.mesh is not None and (dist.dp_size, dist.sp_size) == (1, 1)
        pm = PluginManager(entry_points=False)
        plain, actor = h.tiny_model(), assembly.assemble_actor(pm, h.tiny_model(), cfg, dist)
        assert all(hasattr(p, "full_tensor") for p in actor.parameters())
        prompts, responses = h.sequences([4, 6], [5, 3])
        for model in (plain, actor):
            optimizer, _ = assembly.build_optimizer(pm, model, cfg.actor.optim, 10)
            (-response_logprobs(model, prompts, responses, 1.0, dist.device)[0].mean()).backward()
            optimizer.step()
        assert h.max_param_err(actor, plain) < 1e-6
    finally:
        spmd.shutdown()


def test_ports_chosen_together_are_distinct_and_free():
    """The OS may hand a just-released port out again: ports chosen one after another for the
    same job (the master's and the link's, an engine's and its NCCL's) once collided in CI."""
    import socket

    ports = spmd.free_ports(64)
    assert len(set(ports)) == 64
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))
