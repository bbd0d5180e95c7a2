"""Who writes a run's checkpoints, and when: at once, or in the background (trainer.async_save):
training stops only while the state is copied to host memory, and a thread writes it while the
next steps train (docs/architecture.md, "Checkpoints and resume").

  prepare after the first step: the host buffers made (and pinned, in the background) before
          the first save, so that it stalls training no longer than the later ones
  save    waits for the previous write (raising its error), copies the state, starts the write
  poll    after every step: collects a write that has finished on every rank (the ranks agree
          first, so all of them raise a failed write's error after the same step)
  wait    at the end of the run and on a stop by signal: blocks until the write is done
  close   at the end of the run, after a failure elsewhere too: waits like `wait`, but prints a
          failed write's error instead of raising it (the run's first error is the one reported)
"""

from __future__ import annotations

import datetime
import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch
import torch.distributed as tdist

from minirl.checkpoint import state as ckpt_state
from minirl.checkpoint import store
from minirl.checkpoint.staging import HostStaging
from minirl.dist.context import DistContext


class CheckpointWriter:
    """Writes checkpoints for the training loop; `on_saved(step, path)` runs on the loop's
    thread once a checkpoint is complete on every rank."""

    def __init__(
        self, dist: DistContext, background: bool, timeout_s: float, on_saved: Callable[[int, str], None]
    ) -> None:
        self.dist, self.background, self.timeout_s, self.on_saved = dist, background, timeout_s, on_saved
        self.staging = HostStaging(dist.device) if background else None
        self._pool: ThreadPoolExecutor | None = None  # the background thread, started by prepare or the first save
        self._group = None  # the background write's process group (world > 1)
        self._in_flight: tuple[int, Future] | None = None  # (step, its write)
        self._prepared = False

    def prepare(self, parts: ckpt_state.Checkpointable, save_freq: int) -> None:
        """Make the background save's host buffers now, once (every rank calls at the same step:
        the state dicts of FSDP2 may take collectives); nothing when saves are blocking or never
        due. Call once the state is complete (the AdamW state exists: after a step or a load)."""
        if self._prepared or self.staging is None or save_freq <= 0:
            return
        self._prepared = True
        self.staging.prepare(parts.state_dicts(), self._thread().submit)

    def save(
        self, run_dir: str, step: int, parts: ckpt_state.Checkpointable, trainer_state: dict, config: str, keep: int
    ) -> str:
        """Write ckpt_<step> (every rank calls); returns its path, complete once `wait` returns."""
        self.wait()
        if not self.background:
            path = ckpt_state.save(run_dir, step, parts, trainer_state, config, self.dist, keep)
            self.on_saved(step, path)
            return path
        snap = ckpt_state.snapshot(parts, trainer_state, config, self.dist, self.staging)
        group = self._write_group()
        future = self._thread().submit(ckpt_state.write, run_dir, snap, self.dist, keep, group)
        self._in_flight = (step, future)
        return os.path.join(run_dir, store.ckpt_name(step))

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    def poll(self) -> None:
        """Collect the write in flight if it has finished on every rank (a collective while a
        write is in flight: every rank calls after the same step)."""
        if self._in_flight is not None and self._everyone(self._in_flight[1].done()):
            self._collect()

    def wait(self) -> None:
        """Block until the write in flight is complete; raises its CheckpointWriteError."""
        if self._in_flight is not None:
            self._collect()

    def close(self) -> None:
        """The run is over: wait for the write in flight without raising (after a failure, the
        run's first error is the one to report) and free the host copies."""
        try:
            self.wait()
        except Exception as exc:  # noqa: BLE001 - reported, then the first error goes on
            if self.dist.is_main:
                print(f"minirl: the checkpoint being written failed too: {exc}", file=sys.stderr, flush=True)
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
                self._pool = None
            if self.staging is not None:
                self.staging.buffers.clear()  # as much host memory as the checkpoint

    def _collect(self) -> None:
        step, future = self._in_flight
        self._in_flight = None
        self.on_saved(step, future.result())

    def _everyone(self, done: bool) -> bool:
        """Whether the write is done on every rank (an all-reduce at world > 1)."""
        if self.dist.world_size == 1 or not tdist.is_initialized():
            return done
        flag = torch.tensor([int(done)], device=self.dist.device)
        tdist.all_reduce(flag, op=tdist.ReduceOp.MIN)
        return bool(flag.item())

    def _thread(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="minirl-checkpoint")
        return self._pool

    def _write_group(self):
        """The background write's own gloo group (created by every rank at the first save)."""
        if self._group is None and tdist.is_initialized():
            timeout = datetime.timedelta(seconds=self.timeout_s)
            self._group = tdist.new_group(backend="gloo", timeout=timeout)
        return self._group
