"""Helpers for the python tool's tests: call it as the agent loop does (ToolSet.call_all), and
watch from outside what its code leaves behind (processes found by a name the code gives them)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from minirl.agent.parser import ToolCall
from minirl.agent.tools import ToolEntry, ToolOutcome, ToolSet

# Switches the in-process tripwire off from inside: rebinds the audit hook's class (found through
# the garbage collector) and brings back the functions it replaced (fresh copies of their C
# modules); then proves it: a TCP socket, which the tripwire refuses, is made.
TRIPWIRE_OFF = """
import gc as _gc, os as _os, signal as _signal_module, socket as _socket, subprocess as _subprocess, sys as _sys
for _obj in _gc.get_objects():
    if type(_obj).__name__ == "Tripwire":
        type(_obj).__call__ = lambda self, event, args: None
for _name in ("posix", "_posixsubprocess", "_signal"):
    del _sys.modules[_name]
import posix as _posix, _posixsubprocess, _signal
for _name in ("mkfifo", "mknod", "pidfd_open"):
    setattr(_os, _name, getattr(_posix, _name))
_signal_module.pidfd_send_signal = _signal.pidfd_send_signal
_subprocess._fork_exec = _posixsubprocess.fork_exec
_socket.socket(_socket.AF_INET, _socket.SOCK_STREAM).close()
print("TRIPWIRE-OFF", flush=True)
"""


def bound_in_tmp() -> list[str]:
    """What a sandbox's /tmp holds before the code runs: nothing, unless the Python install or
    virtual environment lives under /tmp (a checkout there), which is bound in read-only."""
    from minirl_plugins.tools import bwrap

    return sorted({d.split("/")[2] for d in bwrap._python_dirs() if d.startswith("/tmp/")})


def call(tool, *codes: str) -> list[ToolOutcome]:
    """One turn of python calls (all at once, concurrently), untruncated by the ToolSet."""
    tools = ToolSet([ToolEntry.of(tool)], max_parallel_calls=len(codes), max_tool_response_length=0)
    try:
        return asyncio.run(tools.call_all([ToolCall("python", {"code": code}, "") for code in codes]))
    finally:
        tools.close()


def mark() -> str:
    """A fresh process name (at most 15 characters: the kernel's limit for /proc/PID/comm)."""
    return "mrl" + uuid.uuid4().hex[:12]


def name_self(name: str) -> str:
    """Code that gives the running process the name `name`, seen from outside in /proc/PID/comm
    (prctl PR_SET_NAME through ctypes: the tripwire must be off)."""
    return f"__import__('ctypes').CDLL(None).prctl(15, {name.encode()!r}, 0, 0, 0)"


def processes_named(name: str) -> list[int]:
    """Host PIDs of the live (not zombie) processes called `name`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "comm").read_text().strip() == name:
                state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
                if state != "Z":
                    found.append(int(entry.name))
        except OSError:
            continue  # gone while we looked
    return found


def status_fields(pid: int, *keys: str) -> dict:
    """Fields of /proc/PID/status (Uid, CapEff, NoNewPrivs, Seccomp...) as strings."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {key: fields[key].split()[0] for key in keys}


def call_watching(tool, code: str, name: str, keys: tuple = ()) -> tuple[ToolOutcome, list[dict]]:
    """Run one call while polling the host's /proc for processes called `name`: the outcome and,
    for each such process seen during the call, its status `keys` (so a test can show that what
    it later finds gone did exist)."""
    seen: dict[int, dict] = {}

    async def watch(done: asyncio.Event):
        while not done.is_set():
            for pid in processes_named(name):
                try:
                    seen.setdefault(pid, status_fields(pid, *keys))
                except (OSError, KeyError):
                    pass
            await asyncio.sleep(0.01)

    async def main():
        tools = ToolSet([ToolEntry.of(tool)], max_tool_response_length=0)
        done = asyncio.Event()
        watcher = asyncio.ensure_future(watch(done))
        try:
            [outcome] = await tools.call_all([ToolCall("python", {"code": code}, "")])
        finally:
            done.set()
            await watcher
            tools.close()
        return outcome

    outcome = asyncio.run(main())
    return outcome, list(seen.values())
