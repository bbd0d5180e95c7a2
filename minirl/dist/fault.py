"""Fault injection for the fault catalogue (tests/integration/test_faults.py): a process dies,
hangs or gets an I/O error at a named point of a step, deterministically instead of by timing.

    MINIRL_FAULT="point=update_actor,step=2,rank=0,action=kill"

point: a phase of the step (gen, reward, old_log_prob, ref, values, update_critic,
update_actor, update_weights) or "checkpoint" (after a rank's shards are written, before the
manifest); step: the training step (any when left out); rank: the global rank (any when left
out); action: kill (SIGKILL itself, as the OOM killer would), stop (SIGSTOP itself: a hang), or
enospc / eio / eperm (raise that OSError). Unset, `point()` is one dictionary lookup.
"""

from __future__ import annotations

import errno
import os
import signal

ENV = "MINIRL_FAULT"
_ERRNOS = {"enospc": errno.ENOSPC, "eio": errno.EIO, "eperm": errno.EACCES}


def _spec() -> dict[str, str] | None:
    text = os.environ.get(ENV, "")
    if not text:
        return None
    return dict(item.split("=", 1) for item in text.split(",") if "=" in item)


def point(name: str, step: int | None = None) -> None:
    """Inject the configured fault when this process reaches point `name` of step `step`."""
    spec = _spec()
    if spec is None or spec.get("point") != name:
        return
    if "step" in spec and step is not None and int(spec["step"]) != step:
        return
    if "rank" in spec and int(spec["rank"]) != int(os.environ.get("RANK", "0")):
        return
    action = spec.get("action", "kill")
    if action in _ERRNOS:
        code = _ERRNOS[action]
        raise OSError(code, os.strerror(code), f"(injected by {ENV} at {name})")
    os.kill(os.getpid(), signal.SIGSTOP if action == "stop" else signal.SIGKILL)
