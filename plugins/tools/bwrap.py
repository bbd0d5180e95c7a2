"""The python tool's boundary: each call in fresh Linux namespaces made by bubblewrap (`bwrap`).

What one call gets (docs/architecture.md says why bubblewrap, docs/agents.md what it enforces):
user, PID, network, mount, IPC, UTS and cgroup namespaces; uid 65534 inside, which is the host's
65534 (nobody) when the trainer runs as root; a root directory holding only /usr, the Python
install and virtual environment, read-only (at their own paths, also when they live under /tmp),
a fresh /proc and a minimal /dev, and a size-capped tmpfs at /tmp, the working directory; no
network interface but a down loopback; no_new_privs, no capabilities, a new session, death with
the trainer; the seccomp filter of seccomp.py.

The sandbox's first process is sandbox_child.py's init (PID 1): when the code's process ends, it
reports the exit status on a pipe and exits, and the kernel ends every process left in the PID
namespace before bwrap, and so this call, returns. A timeout kills PID 1 through a pidfd, taken
while bwrap holds the sandbox at its start, so it cannot hit a recycled PID.

As root, bwrap would map the trainer's uid 0 into the sandbox, where the kernel exempts uid 0 from
the process-count limit and lets it read root's files. So for a root trainer, bwrap waits
(`--userns-block-fd`) while this module writes a uid map holding 0 -> 0 and 65534 -> 65534, and
the init, given CAP_SETUID and CAP_SETGID only for this, becomes 65534 before any code runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from minirl_plugins.tools import seccomp

MIN_VERSION = (0, 7)  # --size for the tmpfs
SANDBOX_ID = 65534
WORKDIR = "/tmp"
CHILD = "/opt/minirl/sandbox_child.py"
TOP_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # links into /usr, or their own dirs
END_WAIT_S = 5.0  # for the kernel to end a killed sandbox's processes (milliseconds in practice)


class SandboxUnavailable(Exception):
    """This machine cannot make the sandbox; the message says what is missing and how to get it."""


@dataclass
class BwrapRun:
    """One running call: bwrap, the pidfd of the sandbox's PID 1, the pipe of the code's status."""

    proc: asyncio.subprocess.Process
    status_fd: int
    pidfd: int | None = None
    fds: list[int] = field(default_factory=list)

    async def finish(self) -> int | None:
        """End every process of the sandbox and wait until the kernel has; the code's exit code
        (minus the signal that killed it), or None when the sandbox never ran it."""
        try:
            if self.pidfd is not None:
                try:
                    signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # already gone: the normal end
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(_readable(self.pidfd), END_WAIT_S)
            if self.proc.returncode is None:
                self.proc.kill()
            await self.proc.wait()
            return _read_status(self.status_fd)
        finally:
            for fd in [self.status_fd, self.pidfd, *self.fds]:
                if fd is not None:
                    os.close(fd)


class Bwrap:
    """How this machine makes a sandbox: the bwrap binary, the read-only view of the Python
    runtime, whether the trainer is root. Built once per tool; raises SandboxUnavailable."""

    def __init__(self, child: Path, python: str = sys.executable):
        self.binary = _find_bwrap()
        self.python = python
        self.root = os.geteuid() == 0
        self.view = _mount_view(child)
        try:
            self.filter = seccomp.program()
        except ValueError as exc:
            raise SandboxUnavailable(str(exc)) from None

    async def start(self, limits: list[int], options: dict, env: dict) -> BwrapRun:
        """Start the sandbox for one call (limits: the worker's, sandbox_child.py); its stdin,
        stdout and stderr are pipes."""
        filter_r = _pipe_holding(self.filter)
        status_r, status_w = os.pipe()
        info_r, info_w = os.pipe()
        block_r, block_w = os.pipe()
        argv = self.argv(options, env, filter_r, info_w, block_r) + [self.python, "-I", "-B", CHILD, "init"]
        argv += [str(status_w), WORKDIR, *map(str, limits)]
        passed = (filter_r, status_w, info_w, block_r)
        try:
            proc = await spawn(argv, pass_fds=passed, env={"PATH": "/usr/bin:/bin"})
        except BaseException:
            for fd in (*passed, status_r, info_r, block_w):
                os.close(fd)
            raise
        for fd in passed:
            os.close(fd)
        run = BwrapRun(proc, status_r, fds=[info_r, block_w])
        try:
            await self._release(run, info_r, block_w)
        except BaseException:
            await run.finish()
            raise
        return run

    async def _release(self, run: BwrapRun, info_r: int, block_w: int) -> None:
        """While bwrap holds the sandbox: take a pidfd of its PID 1 and, for a root trainer, write
        its uid and gid maps; then let it run. No info: bwrap failed, its stderr says why."""
        info = await _read_all(info_r)
        pid = json.loads(info).get("child-pid") if info else None
        with contextlib.suppress(ProcessLookupError):  # gone already: its set-up failed
            run.pidfd = os.pidfd_open(pid) if pid is not None else None
            if run.pidfd is not None and self.root:
                for name in ("uid_map", "gid_map"):
                    Path(f"/proc/{pid}/{name}").write_text(f"0 0 1\n{SANDBOX_ID} {SANDBOX_ID} 1\n")
        try:
            os.write(block_w, b"1")
        except BrokenPipeError:
            pass  # bwrap is gone already

    def argv(self, options: dict, env: dict, filter_fd: int, info_fd: int, block_fd: int) -> list[str]:
        """The bwrap command line, up to the command."""
        if self.root:
            user = ["--userns-block-fd", str(block_fd), "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:
            user = ["--uid", str(SANDBOX_ID), "--gid", str(SANDBOX_ID), "--block-fd", str(block_fd)]
        env = {**env, "HOME": WORKDIR, "TMPDIR": WORKDIR}
        setenv = [arg for key, value in env.items() for arg in ("--setenv", key, value)]
        tmpfs = ["--perms", "1777", "--size", str(options["disk_mb"] << 20), "--tmpfs", WORKDIR]
        return [
            self.binary,
            *("--unshare-all", "--unshare-user", "--hostname", "sandbox", "--info-fd", str(info_fd)),
            *("--cap-drop", "ALL", *user, "--die-with-parent", "--new-session", "--as-pid-1"),
            *tmpfs,  # before the view: a Python install or venv under /tmp is bound on top of it
            *self.view,
            *("--chdir", WORKDIR, "--clearenv", *setenv, "--seccomp", str(filter_fd), "--"),
        ]


async def spawn(argv: list[str], **popen) -> asyncio.subprocess.Process:
    """`argv` with stdin, stdout and stderr piped, in a session of its own (so that no terminal's
    signals reach it, and a process group that can be killed)."""
    pipe = asyncio.subprocess.PIPE
    return await asyncio.create_subprocess_exec(
        *argv, stdin=pipe, stdout=pipe, stderr=pipe, start_new_session=True, **popen
    )


def _find_bwrap() -> str:
    binary = shutil.which("bwrap") or ("/usr/bin/bwrap" if os.access("/usr/bin/bwrap", os.X_OK) else None)
    if binary is None:
        raise SandboxUnavailable(
            "bubblewrap (bwrap) is not installed; install it once: `apt-get install bubblewrap` (Debian, "
            "Ubuntu), `dnf install bubblewrap` (Fedora, RHEL)"
        )
    out = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    found = re.search(r"(\d+)\.(\d+)", out)
    version = tuple(map(int, found.groups())) if found else (0, 0)
    if version < MIN_VERSION:
        need = ".".join(map(str, MIN_VERSION))
        raise SandboxUnavailable(
            f"{binary} is {out.strip() or 'of an unknown version'}; the sandbox needs bubblewrap {need} or newer "
            "(its tmpfs --size); install a newer one (Debian 12, Ubuntu 24.04 and Fedora ship one)"
        )
    return binary


def _mount_view(child: Path) -> list[str]:
    """/usr, the top-level links into it, the Python install and virtual environment, read-only;
    the tool's child program; a new /proc and a minimal /dev. Nothing else of the host."""
    view = ["--ro-bind", "/usr", "/usr"]
    for top in TOP_DIRS:
        if os.path.islink(top):
            view += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            view += ["--ro-bind", top, top]
    for path in _python_dirs():
        view += ["--dir", os.path.dirname(path), "--ro-bind", path, path]  # bwrap would make the parents 0700
    view += ["--dir", os.path.dirname(CHILD), "--ro-bind", str(child), CHILD]
    return view + ["--proc", "/proc", "--dev", "/dev"]


def _python_dirs() -> list[str]:
    """The prefixes of the running Python (its install, its virtual environment) outside /usr,
    outermost only."""
    prefixes = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix}
    prefixes.add(str(Path(sys.executable).resolve().parent.parent))  # a venv's python links into its install
    dirs = sorted({os.path.abspath(p) for p in prefixes} - {"/"})
    outside = [d for d in dirs if not _under(d, "/usr")]
    return [d for d in outside if not any(d != o and _under(d, o) for o in outside)]


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _pipe_holding(data: bytes) -> int:
    """The read end of a pipe that holds `data` and then ends (bwrap reads the filter to EOF)."""
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, data)  # far below a pipe's 64 KiB buffer
    finally:
        os.close(write_fd)
    return read_fd


def _read_status(fd: int) -> int | None:
    os.set_blocking(fd, False)
    try:
        text = os.read(fd, 64)
    except BlockingIOError:
        return None
    return int(text) if text.strip().lstrip(b"-").isdigit() else None


async def _readable(fd: int) -> None:
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(fd)


async def _read_all(fd: int) -> bytes:
    """Everything written to the pipe `fd` until its writers close it."""
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            await _readable(fd)
            continue
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
