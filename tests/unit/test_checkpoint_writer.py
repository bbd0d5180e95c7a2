"""The background checkpoint write (trainer.async_save, minirl.checkpoint.writer): the save
returns once the state is copied to host memory and the checkpoint holds that moment's state;
the next save and the end of the run wait for the write in flight; retention counts finished
checkpoints only; the host buffers are reused; a failed write is raised once, at the next wait,
with the previous checkpoint intact. Writes are held on an Event (never by timing) so that the
write in flight is in flight for sure."""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from pathlib import Path

import pytest
import torch

from minirl.checkpoint import staging, store
from minirl.checkpoint import state as ckpt_state
from minirl.checkpoint.writer import CheckpointWriter
from minirl.dist.context import DistContext
from minirl.errors import UserError

DIST = DistContext(device=torch.device("cpu"))


def trainer_state(step: int) -> dict:
    return {"step": step, "data": {}, "schedulers": {}, "kl_coef": None, "seed": 1, "world_size": 1}


@pytest.fixture
def parts() -> ckpt_state.Checkpointable:
    return make_parts()


def make_parts() -> ckpt_state.Checkpointable:
    """A small model with its AdamW state (one step taken, so exp_avg/exp_avg_sq exist)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    return ckpt_state.Checkpointable(model, optimizer)


class Held:
    """Holds every background write of the listed steps until `release()`."""

    def __init__(self, monkeypatch, steps: tuple[int, ...]) -> None:
        self.gate, self.steps = threading.Event(), steps
        write = ckpt_state._write_rank_files

        def held(tmp, snap, group=None):
            if snap.step in self.steps:
                assert self.gate.wait(60), "the test never released the write"
            return write(tmp, snap, group)

        monkeypatch.setattr(ckpt_state, "_write_rank_files", held)

    def release(self) -> None:
        self.gate.set()


@pytest.fixture
def hold(monkeypatch):
    """hold(*steps): a Held for those steps, released at the end of the test whatever happens
    (a write left waiting would keep the interpreter from exiting)."""
    made: list[Held] = []

    def hold_steps(*steps: int) -> Held:
        made.append(Held(monkeypatch, steps))
        return made[-1]

    yield hold_steps
    for held in made:
        held.release()


def writer(saved: list, background: bool = True) -> CheckpointWriter:
    return CheckpointWriter(DIST, background, 60, lambda step, path: saved.append((step, path)))


def save(w: CheckpointWriter, run_dir: Path, step: int, parts, keep: int = 0) -> str:
    return w.save(str(run_dir), step, parts, trainer_state(step), "", keep)


def complete(run_dir: Path) -> list[int]:
    return [step for step, _ in store.complete_checkpoints(str(run_dir))]


def weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_the_save_returns_before_the_write_and_keeps_that_moment(tmp_path, parts, hold):
    """The save returns with the write held (no ckpt_1 yet, the hook not fired); the weights
    changed after it (the next step training) do not reach ckpt_1, which holds the weights of
    the moment of the save once the write is released."""
    held, saved = hold(1), []
    w = writer(saved)
    before = weights(parts.model)
    path = save(w, tmp_path, 1, parts)
    assert w.in_flight and complete(tmp_path) == [] and saved == []
    with torch.no_grad():
        for p in parts.model.parameters():
            p.add_(1.0)
    held.release()
    w.wait()
    assert saved == [(1, path)] and complete(tmp_path) == [1] and store.damaged_files(path) == []
    ckpt_state.load(path, parts, DIST)
    assert all(torch.equal(a, b) for a, b in zip(weights(parts.model), before))


def test_the_next_save_waits_for_the_previous(tmp_path, parts, hold):
    """save(2) blocks while ckpt_1's write is held, then both complete in order."""
    held, saved = hold(1), []
    w = writer(saved)
    save(w, tmp_path, 1, parts)
    second = threading.Thread(target=save, args=(w, tmp_path, 2, parts))
    second.start()
    second.join(0.3)
    assert second.is_alive() and complete(tmp_path) == []  # it cannot pass while the gate is shut
    held.release()
    second.join(60)
    w.wait()
    assert [step for step, _ in saved] == [1, 2] and complete(tmp_path) == [1, 2]


def test_wait_returns_once_the_checkpoint_is_complete(tmp_path, parts, hold):
    """The end of a run: wait() blocks until the write in flight is complete and its hook has
    fired; afterwards nothing is in flight and another wait returns at once."""
    held, saved = hold(1), []
    w = writer(saved)
    save(w, tmp_path, 1, parts)
    waiting = threading.Thread(target=w.wait)
    waiting.start()
    waiting.join(0.3)
    assert waiting.is_alive() and saved == []
    held.release()
    waiting.join(60)
    assert not waiting.is_alive() and complete(tmp_path) == [1] and len(saved) == 1
    assert not w.in_flight
    w.wait()
    assert len(saved) == 1


def test_poll_collects_a_finished_write_and_only_then(tmp_path, parts, hold):
    """After a step: poll() leaves a write in flight alone and collects a finished one (the
    hook fires once)."""
    held, saved = hold(1), []
    w = writer(saved)
    save(w, tmp_path, 1, parts)
    w.poll()
    assert w.in_flight and saved == []
    held.release()
    w._in_flight[1].result(60)  # finished, not collected
    w.poll()
    assert not w.in_flight and [step for step, _ in saved] == [1]
    w.poll()
    assert len(saved) == 1


def test_max_ckpt_to_keep_counts_only_finished_checkpoints(tmp_path, parts, hold):
    """keep = 1: while ckpt_2 is being written ckpt_1 is the only complete checkpoint and is
    kept; once ckpt_2 is complete, ckpt_1 is pruned."""
    held = hold(2)
    w = writer([])
    save(w, tmp_path, 1, parts, keep=1)
    w.wait()
    save(w, tmp_path, 2, parts, keep=1)
    assert complete(tmp_path) == [1] and w.in_flight
    held.release()
    w.wait()
    assert complete(tmp_path) == [2] and not (tmp_path / "ckpt_1").exists()


def test_the_host_buffers_are_reused_between_saves(tmp_path, parts):
    """Every save after the first copies into the same host buffers (none allocated, the same
    addresses), never aliasing the live tensors; the copies hold the live values."""
    w = writer([])
    save(w, tmp_path, 1, parts)
    w.wait()
    first = {path: t.data_ptr() for path, t in w.staging.buffers.items()}
    allocated = w.staging.allocations
    live = {t.data_ptr() for t in ckpt_state._tensors(parts.state_dicts())}
    for step in (2, 3):
        save(w, tmp_path, step, parts)
        w.wait()
    assert w.staging.allocations == allocated == len(first) > 0
    assert {path: t.data_ptr() for path, t in w.staging.buffers.items()} == first
    assert not live & set(first.values())
    staged = [w.staging.buffers[("model", name)] for name in parts.model.state_dict()]
    assert all(torch.equal(s, p) for s, p in zip(staged, parts.model.state_dict().values()))


def test_a_failed_background_write_is_raised_at_the_next_wait(tmp_path, parts, monkeypatch):
    """ckpt_2's write fails (no space): wait() raises the one-line CheckpointWriteError, the
    temporary directory is removed, ckpt_1 is intact and still `latest`; nothing is in flight
    afterwards, so the error is raised once."""
    w, saved = writer([]), []
    save(w, tmp_path, 1, parts)
    w.wait()
    monkeypatch.setenv("MINIRL_FAULT", "point=checkpoint,step=2,action=enospc")
    save(w, tmp_path, 2, parts)
    with pytest.raises(ckpt_state.CheckpointWriteError, match="No space left on device") as err:
        w.wait()
    assert f"the previous checkpoint {tmp_path / 'ckpt_1'} is intact" in str(err.value)
    assert complete(tmp_path) == [1] and not (tmp_path / ".tmp_ckpt_2").exists()
    assert (tmp_path / "latest").read_text().strip() == "ckpt_1"
    assert not w.in_flight and saved == []
    w.wait()


def test_close_after_a_failure_reports_a_failed_write_instead_of_raising(tmp_path, parts, monkeypatch, capsys):
    """The run is failing already: close() waits for the write in flight and prints its error
    (the run's first error is the one reported), and frees the host copies."""
    monkeypatch.setenv("MINIRL_FAULT", "point=checkpoint,step=1,action=eio")
    w = writer([])
    save(w, tmp_path, 1, parts)
    w.close()
    err = capsys.readouterr().err
    assert "minirl: the checkpoint being written failed too: writing checkpoint" in err
    assert "Input/output error" in err and not w.in_flight and w.staging.buffers == {}


def test_a_blocking_writer_saves_before_it_returns(tmp_path, parts):
    """async_save = false: the checkpoint is complete and its hook fired when save() returns,
    and no host copy is kept."""
    saved = []
    w = writer(saved, background=False)
    path = save(w, tmp_path, 1, parts)
    assert saved == [(1, path)] and complete(tmp_path) == [1] and not w.in_flight and w.staging is None
    assert os.path.isfile(os.path.join(path, store.MANIFEST))


def contents(ckpt: str) -> tuple[dict[str, bytes], list[torch.Tensor]]:
    """The small files' bytes, and every tensor as read back (the shards' bytes are not
    compared: with torch.save's own CRC switched off, its zip records' CRC fields vary)."""
    files = {name: (Path(ckpt) / name).read_bytes() for name in ("rng/rank0.pt", ckpt_state.TRAINER_STATE)}
    fresh = make_parts()
    with torch.no_grad():  # so that only the load can make them equal
        for t in ckpt_state._tensors(fresh.state_dicts()):
            t.zero_()
    ckpt_state.load(ckpt, fresh, DIST)
    return files, list(ckpt_state._tensors(fresh.state_dicts()))


def test_a_prepared_first_save_copies_into_the_prepared_buffers(tmp_path, parts):
    """prepare() makes every buffer before the first save, which allocates none and copies into
    them; its checkpoint is byte for byte the one an unprepared writer writes."""
    w = writer([])
    w.prepare(parts, save_freq=1)
    w.staging.join()
    prepared = {path: t.data_ptr() for path, t in w.staging.buffers.items()}
    assert w.staging.allocations == len(prepared) == len(list(ckpt_state._tensors(parts.state_dicts())))
    first = save(w, tmp_path / "prepared", 1, parts)
    w.wait()
    assert w.staging.allocations == len(prepared)
    assert {path: t.data_ptr() for path, t in w.staging.buffers.items()} == prepared
    plain = writer([])
    other = save(plain, tmp_path / "plain", 1, parts)
    plain.wait()
    (files, tensors), (other_files, other_tensors) = contents(first), contents(other)
    assert files == other_files and len(tensors) == len(other_tensors) == len(prepared)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(tensors, other_tensors))


def test_prepare_does_nothing_when_no_background_save_is_due(tmp_path, parts):
    """save_freq <= 0 (no saves), or blocking saves: no buffer, no thread."""
    never = writer([])
    never.prepare(parts, save_freq=0)
    assert never.staging.buffers == {} and never.staging.allocations == 0 and never._pool is None
    blocking = writer([], background=False)
    blocking.prepare(parts, save_freq=1)
    assert blocking.staging is None and blocking._pool is None


class FakeCudart:
    """torch.cuda.cudart() on a CPU build: records (call, pointer, thread), fails on request."""

    def __init__(self, code: int = 0) -> None:
        self.calls: list[tuple[str, int, str]] = []
        self.code = code

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        self.calls.append(("register", ptr, threading.current_thread().name))
        return self.code

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr, threading.current_thread().name))
        return 0


@pytest.fixture
def pinned(monkeypatch):
    """A writer whose staging pins as on CUDA (through a FakeCudart) every tensor of 256 bytes
    or more; copies are recorded as ("copy", destination pointer, thread)."""
    cudart = FakeCudart()
    monkeypatch.setattr(staging, "PIN_MIN_BYTES", 256)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    copy_ = torch.Tensor.copy_

    def recorded(self, src, non_blocking=False):
        cudart.calls.append(("copy", self.data_ptr(), threading.current_thread().name))
        return copy_(self, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", recorded)
    w = writer([])
    w.staging.pin = True
    return w, cudart


def test_an_unprepared_buffer_is_pinned_before_it_is_copied_into(tmp_path, parts, pinned):
    """The first save without prepare: each large buffer is registered, then copied into (a
    pinned copy, not a pageable one through a bounce buffer); unregistered once freed."""
    w, cudart = pinned
    save(w, tmp_path, 1, parts)
    w.wait()
    big = {t.data_ptr() for t in w.staging.buffers.values() if t.nbytes >= 256}
    events = [(call, ptr) for call, ptr, _ in cudart.calls if ptr in big]
    assert len(big) >= 2 and all(events.index(("register", p)) < events.index(("copy", p)) for p in big)
    w.close()
    gc.collect()
    assert {ptr for call, ptr, _ in cudart.calls if call == "unregister"} == big


def test_prepare_pins_on_the_background_thread_and_the_save_only_copies(tmp_path, parts, pinned):
    """prepare(): the large buffers are registered on the checkpoint thread; the first save
    registers nothing and copies into each buffer once, on the training loop's thread."""
    w, cudart = pinned
    w.prepare(parts, save_freq=1)
    w.staging.join()
    big = {t.data_ptr() for t in w.staging.buffers.values() if t.nbytes >= 256}
    assert len(big) >= 2
    assert {(call, ptr) for call, ptr, _ in cudart.calls} == {("register", ptr) for ptr in big}
    assert {thread for _, _, thread in cudart.calls} == {"minirl-checkpoint_0"}
    cudart.calls.clear()
    save(w, tmp_path, 1, parts)
    w.wait()
    main = threading.current_thread().name
    assert [call for call, _, _ in cudart.calls] == ["copy"] * w.staging.allocations
    assert {thread for _, _, thread in cudart.calls} == {main}


def test_a_failed_preparation_is_raised_at_the_next_save(tmp_path, parts, pinned):
    """Pinning refused on the background thread: the next save raises its UserError (once),
    and writes nothing."""
    w, cudart = pinned
    cudart.code = 2  # cudaErrorMemoryAllocation
    w.prepare(parts, save_freq=1)
    with pytest.raises(UserError, match="page-locking .* failed \\(CUDA error 2\\)"):
        save(w, tmp_path, 1, parts)
    assert not w.in_flight and complete(tmp_path) == []
    w.staging.join()  # raised once
