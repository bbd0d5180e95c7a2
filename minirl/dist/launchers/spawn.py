"""The supervisor of the local launcher: one fresh process per rank on this machine. The first
worker that fails makes it kill all others (they may sit in a collective with it) and print its
report once, naming the cause (a rank killed by a signal, a stopped rank) over its
consequences; reports travel through files, not pipes, so a long traceback cannot block a dying
worker. SIGTERM/SIGINT are forwarded; a worker whose supervisor died exits within a second.
"""

from __future__ import annotations

import atexit
import dataclasses
import faulthandler
import json
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

from minirl.dist.launchers import EXIT_CRASH, Report, print_report, report_of
from minirl.dist.signals import SignalHandler
from minirl.dist.spmd import free_ports

_STOP_GRACE_S = 5.0  # how long a stopped worker may take to exit before it is killed


def spawn(fn: Callable[..., Any], world: int, args: tuple = ()) -> int:
    """Run fn(rank, *args) in `world` fresh processes that form one process group's environment;
    0 when all succeed, else the failed worker's status after its error is printed. fn and args
    must pickle (a module-level function; a frozen config does)."""
    ctx = multiprocessing.get_context("spawn")  # fork would copy CUDA and thread state
    error_dir = tempfile.mkdtemp(prefix="minirl-errors-")
    master_port, link_port = free_ports(2)  # the link: an asynchronous job's (minirl.dist.link)
    world_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port), "NODE_RANK": "0"}
    world_env["MINIRL_LINK_PORT"] = str(link_port)
    world_env.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    procs = [
        ctx.Process(
            target=_worker_main, args=(fn, rank, args, world_env, error_dir, os.getpid()), name=f"minirl-rank{rank}"
        )
        for rank in range(world)
    ]
    try:
        for p in procs:
            p.start()
        with _ForwardSignals(procs):
            failed = _wait_first_failure(procs)
        hung = _stopped_ranks(procs)  # before _stop: a SIGSTOPped rank is the cause of a timeout
        killed = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode is not None and p.exitcode < 0}
        # the others may be blocked in a collective with the failed rank, and cannot finish a step
        # or a checkpoint without it: SIGKILL at once (SIGTERM would start a graceful stop)
        _stop(procs, grace_s=0.0 if failed is not None and failed.exitcode not in _STOP_CODES else _STOP_GRACE_S)
        if failed is None:
            return 0
        if hung:
            return print_report(hung[0], Report("died", _hung_reason(procs.index(failed)), EXIT_CRASH))
        return _report(procs.index(failed), failed.exitcode, error_dir, killed)
    finally:
        _stop(procs)
        shutil.rmtree(error_dir, ignore_errors=True)


def _worker_main(fn, rank: int, args: tuple, env: dict[str, str], error_dir: str, parent_pid: int) -> None:
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    # a rank killed by a fatal signal (SIGSEGV, SIGABRT from C++) prints every thread's Python
    # stack first: the report then names the rank, and its stderr says where it was
    faulthandler.enable(all_threads=True)
    threading.Thread(target=exit_with_parent, args=(parent_pid,), daemon=True).start()
    try:
        fn(rank, *args)
    except BaseException as exc:  # noqa: BLE001 - report everything, the parent decides what to show
        report = report_of(exc)
        _write_error(error_dir, rank, report)
        sys.exit(report.exit_code)
    leave(0)


def leave(code: int) -> NoReturn:
    """Exit with `code` once the job is over (its process groups destroyed, its files closed) without the
    interpreter's teardown, which could only fail: a C++ thread of a torch.distributed backend
    that outlives destroy_process_group and frees a tensor needing the GIL while the interpreter
    is being finalized aborts the process ("terminate called without an active exception",
    pytorch/pytorch#190489), after all its work was done: a CI run lost a finished rank of an
    asynchronous job so, and a torchrun rank of a finished job exited -6 so. The atexit handlers
    (a tracker's upload among them) still run."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _write_error(error_dir: str, rank: int, report: Report) -> None:
    path = os.path.join(error_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({**dataclasses.asdict(report), "time": time.time()}, f)
    os.replace(path + ".tmp", path)  # the supervisor never reads half a report


def exit_with_parent(parent_pid: int) -> None:
    """A worker whose supervisor died (kill -9) must not live on holding a GPU (a thread's target:
    the rank workers', minirl.precompile's twin's)."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


class _ForwardSignals(SignalHandler):
    """The supervisor passes SIGTERM/SIGINT on: the first as SIGTERM (workers finish the step and
    checkpoint), a second as SIGKILL. Kubernetes signals only the container's first process, so
    the workers would otherwise never hear of it."""

    repeat_window_s = 0.0  # every signal counts; the workers' own handlers tell repeats apart

    def __init__(self, procs: list):
        super().__init__()
        self.procs = procs

    def _request(self, signum: int) -> None:
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


def _report(rank: int, exitcode: int, error_dir: str, killed: dict[int, int] | None = None) -> int:
    """Print the failed worker's error (or the earliest report, if it left none) once. `killed`:
    the ranks a signal had ended before the supervisor stopped the others (kill -9, the OOM
    killer): when the failed rank only lost its peer, the cause is the killed rank."""
    reports = {}
    for name in os.listdir(error_dir):
        if name.endswith(".json"):
            with open(os.path.join(error_dir, name)) as f:
                reports[int(name[4:-5])] = json.load(f)
    # the others' reports of being stopped (by the supervisor) or of losing a peer are consequences
    causes = {r: rep for r, rep in reports.items() if rep["kind"] not in ("stopped", "peer")}
    silent = {r: code for r, code in (killed or {}).items() if r not in reports}
    if silent and not causes and (rank not in reports or reports[rank]["kind"] == "peer"):
        rank, exitcode = min(silent.items())
    if rank not in reports and causes:
        rank = min(causes, key=lambda r: causes[r]["time"])
    if rank not in reports:  # killed by a signal (the OOM killer, say): nothing was written
        return print_report(rank, Report("died", _exit_reason(exitcode), EXIT_CRASH))
    found = reports[rank]
    return print_report(rank, Report(found["kind"], found["text"], found["exit_code"]))


def _stopped_ranks(procs: list) -> list[int]:
    """Ranks whose process is stopped (SIGSTOP, SIGTSTP, a debugger): alive but never answering,
    so its peers' collectives time out. Linux's /proc; elsewhere none are found."""
    ranks = []
    for rank, p in enumerate(procs):
        try:
            with open(f"/proc/{p.pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]  # the field after "(name)"
        except (OSError, IndexError, TypeError):
            continue
        if state in ("T", "t"):
            ranks.append(rank)
    return ranks


def _hung_reason(timed_out_rank: int) -> str:
    return (
        f"stopped by a signal (SIGSTOP or SIGTSTP: process state T) and never answered; rank {timed_out_rank}'s "
        "collective timed out waiting for it after trainer.collective_timeout_s"
    )


def _stop(procs: list, grace_s: float = _STOP_GRACE_S) -> None:
    """SIGTERM every live worker, SIGKILL those still alive after grace_s (a stopped one at once)."""
    procs = [p for p in procs if p.pid is not None]  # started ones only
    for p in procs:
        if p.is_alive() and grace_s > 0:
            p.terminate()
        elif p.is_alive():
            p.kill()
    for rank in _stopped_ranks(procs):  # a stopped process never handles SIGTERM
        procs[rank].kill()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _exit_reason(exitcode: int) -> str:
    """ "killed by SIGKILL" for a negative exit code (multiprocessing's signal), else the code."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            pass
    return f"exit code {exitcode}"
