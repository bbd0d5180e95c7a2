"""Worker processes for slow reward functions that survive calls that hang or crash.

concurrent.futures.ProcessPoolExecutor cannot stop a running task, and a worker that dies
(os.abort, a segfault) breaks the whole executor (BrokenProcessPool). Here every worker has its
own pipe: a call still running after `timeout_s` gets its worker killed, a worker that dies is
seen through its sentinel; either way that call's rows score as a "timeout" or a "crash", the
worker is replaced and the other calls go on. Results come back in the order of the calls.

Workers are forked from multiprocessing's forkserver, which imports this module (and so torch)
once: starting or replacing a worker costs milliseconds, and the training process, with its
threads and CUDA state, is never forked. A new worker loads its reward functions once
(`RewardSource.load`) and says "ready" before it gets a call, so loading never counts against
a call's timeout.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import time
from collections import deque
from multiprocessing.connection import wait
from typing import Any, Callable, Sequence

from minirl.errors import UserError, describe
from minirl.reward.scorers import Outcome, Row

STARTUP_TIMEOUT_S = 300.0  # loading the reward functions (imports) in a new worker
STOP_GRACE_S = 2.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _context():
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])  # no effect once the forkserver runs (it then already has it)
    return ctx


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when its parent, the forkserver, exits, so that a hung reward
    call never outlives a trainer killed with -9. The forkserver exits when the last holder of
    its "alive" pipe closes it; CPython hands that pipe to every forked child, so the worker
    closes its copy, leaving the trainer the only holder."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if isinstance(fd, int):
        os.close(fd)
        server._forkserver_alive_fd = None
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux/glibc: idle workers still exit on EOF
        pass


def _serve(conn, load: Callable[[], Any]) -> None:
    """A worker's loop: load the scorers, say ready, then answer calls until None or EOF. The
    worker leads a process group of its own, so that killing it (a timeout, close()) also kills
    the processes its reward function started."""
    _die_with_parent()
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle (StopRequest)
    try:
        scorers, fatal = load(), ""
    except Exception as exc:  # noqa: BLE001 - reported to the trainer, which raises it
        scorers, fatal = None, str(exc) if isinstance(exc, UserError) else describe(exc)
    conn.send(("ready", fatal))
    while True:
        try:
            rows = conn.recv()
        except EOFError:  # the trainer is gone
            return
        if rows is None:
            return
        if fatal:
            conn.send(("fatal", fatal))
            continue
        try:
            conn.send(("ok", scorers.run(rows)))
        except UserError as exc:  # e.g. a batch function's wrong length: the trainer raises it
            conn.send(("fatal", str(exc)))


class _Worker:
    def __init__(self, ctx, load: Callable[[], Any]):
        self.conn, child = ctx.Pipe()
        # not daemonic: a reward function may start processes of its own (daemonic ones may not)
        self.process = ctx.Process(target=_serve, args=(child, load), daemon=False, name="minirl-reward")
        self.process.start()
        child.close()
        self.ready = False
        self.index: int | None = None  # the call it is running
        self.deadline = time.monotonic() + STARTUP_TIMEOUT_S

    def assign(self, index: int, rows: Sequence[Row], timeout_s: float) -> bool:
        """Send a call; False when the worker is already gone (it is replaced on the next wait)."""
        try:
            self.conn.send(list(rows))
        except OSError:
            return False
        self.index, self.deadline = index, time.monotonic() + timeout_s
        return True

    def receive(self) -> Any:
        """The next message, or None when the worker died."""
        try:
            return self.conn.recv() if self.conn.poll() else None
        except (EOFError, OSError):
            return None

    def kill(self) -> None:
        """SIGKILL the worker and its process group (what its reward function started)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # gone, or it never led its group yet
            pass
        self.process.kill()
        self.process.join()
        self.conn.close()

    def stop(self) -> None:
        """Ask the worker to exit; kill it when it has not after STOP_GRACE_S (a hung call)."""
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.process.join(STOP_GRACE_S)
        self.kill()  # a no-op signal for a worker that has exited


class RewardPool:
    """num_workers processes running reward calls, each call limited to timeout_s."""

    def __init__(self, load: Callable[[], Any], num_workers: int, timeout_s: float):
        self.load, self.num_workers, self.timeout_s = load, num_workers, timeout_s
        self.workers: list[_Worker] = []
        self._ctx = None

    def run(self, calls: Sequence[Sequence[Row]]) -> list[list[Outcome]]:
        """Each call's outcomes, in call order; a call that times out or whose worker dies gives
        every one of its rows that failure."""
        if not self.workers:
            if self._ctx is None:
                self._ctx = _context()
                # before multiprocessing's own exit handler, which joins non-daemonic workers
                atexit.register(self.close)
            self.workers = [_Worker(self._ctx, self.load) for _ in range(self.num_workers)]
        results: list[list[Outcome] | None] = [None] * len(calls)
        todo = deque(range(len(calls)))
        try:
            while todo or any(w.index is not None for w in self.workers):
                for w in self.workers:
                    if w.ready and w.index is None and todo and w.assign(todo[0], calls[todo[0]], self.timeout_s):
                        todo.popleft()
                self._wait(calls, results)
        except BaseException:  # no worker may keep a call whose answer nobody will read
            self.close()
            raise
        return results  # type: ignore[return-value]

    def _wait(self, calls, results) -> None:
        """Block until a worker answers, dies or passes its deadline; handle whatever happened."""
        now = time.monotonic()
        busy = [w.deadline for w in self.workers if not w.ready or w.index is not None]
        handles = [w.conn for w in self.workers] + [w.process.sentinel for w in self.workers]
        wait(handles, max(0.0, min(busy, default=now) - now))
        for k, w in enumerate(self.workers):
            message = w.receive()
            if message is not None:
                self._handle(w, message, results)
            elif not w.process.is_alive():
                self._replace(k, "crash", f"the worker died ({_exit_reason(w.process.exitcode)})", calls, results)
            elif (not w.ready or w.index is not None) and time.monotonic() >= w.deadline:
                self._replace(k, "timeout", f"still running after {self.timeout_s:g} s", calls, results)

    def _handle(self, w: _Worker, message: tuple, results) -> None:
        kind, payload = message
        if kind == "ready":
            if payload:
                self.close()
                raise UserError(f"a reward worker could not load the reward functions: {payload}")
            w.ready = True
            return
        if kind == "fatal":
            self.close()
            raise UserError(payload)
        results[w.index], w.index = payload, None

    def _replace(self, k: int, failure: str, detail: str, calls, results) -> None:
        w = self.workers[k]
        if not w.ready:  # it never finished loading the reward functions: every new one would fail alike
            w.kill()
            self.close()
            how = detail if failure == "crash" else f"not done after {STARTUP_TIMEOUT_S:g} s"
            raise UserError(f"a reward worker failed while loading the reward functions: {how}")
        if w.index is not None:
            results[w.index] = [Outcome(failure=failure, detail=detail) for _ in calls[w.index]]
        w.kill()
        self.workers[k] = _Worker(self._ctx, self.load)

    def close(self) -> None:
        """Stop every worker (a hung one is killed); the pool starts afresh on the next run()."""
        workers, self.workers = self.workers, []
        for w in workers:
            w.stop()


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"
