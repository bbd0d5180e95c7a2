"""python: runs the model's code in a sandbox and returns what it printed.

`sandbox = "bwrap"` (the default): each call runs in fresh Linux namespaces made by bubblewrap,
under a seccomp filter (bwrap.py, seccomp.py): no network, no view of the host's files beyond the
Python runtime (read-only), no view of or signal to the trainer or any other process, a
size-capped tmpfs as the working directory, a cap on processes, and every process ended when
the call returns or times out. A machine that cannot make the sandbox fails the tool's start with
one line saying what is missing. `sandbox = "process"`: the code runs in a plain child process
in a temporary directory of the host: no boundary at all, for trusted code only (it warns).

In both, the code's process (sandbox_child.py) has stdin closed, a minimal environment, resource
limits (address space memory_mb, CPU seconds cpu_s, file size file_size_mb, open files
max_open_files) and an audit-hook tripwire that refuses the obvious escapes with a clear message.
The tool message is stdout then stderr, cut to max_output_chars (the middle goes, so the start of
the output and the end of a traceback stay). Hitting the memory or CPU limit is a ToolError that
says which; the wall-clock limit (timeout_s) raises TimeoutError, which the ToolSet reports as a
timeout. Everything runs under asyncio, so the event loop (and every other sample's decoding,
and other calls) keeps going meanwhile.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from minirl.agent.tools import ToolError, tool_options, truncate
from minirl.errors import UserError
from minirl_plugins.tools.bwrap import Bwrap, SandboxUnavailable, spawn

CHILD = Path(__file__).with_name("sandbox_child.py")
DEFAULTS = {
    "sandbox": "bwrap",
    "timeout_s": 10.0,
    "memory_mb": 512,
    "cpu_s": 5,
    "file_size_mb": 16,
    "max_open_files": 64,
    "max_processes": 16,
    "disk_mb": 64,
    "max_output_chars": 4096,
}
SANDBOXES = ("bwrap", "process")
BWRAP_ONLY = ("max_processes", "disk_mb")
DESCRIPTIONS = {
    "bwrap": (
        "Run Python 3 code in a fresh sandbox and return what it prints (stdout, then stderr). The sandbox has "
        "no network and sees only the Python installation; its only writable place is the current directory "
        "/tmp (at most {disk_mb} MB, erased after the call). Time, memory and processes are limited. print() "
        "the values you want to see."
    ),
    "process": (
        "Run Python 3 code in a fresh process and return what it prints (stdout, then stderr). Time and memory "
        "are limited. print() the values you want to see."
    ),
}
# one thread each for the numeric libraries: every thread reserves address space, and a 512 MB
# limit would not survive OpenBLAS starting one per core on a large machine
ENV = {
    "PATH": "/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MALLOC_ARENA_MAX": "2",
}


class PythonTool:
    """The python tool; config keys and defaults in DEFAULTS (seconds, megabytes, characters)."""

    name = "python"

    def __init__(self, config: dict):
        self.options = tool_options(config, DEFAULTS, self.name)
        self.timeout_s = self.options["timeout_s"]
        self.sandbox = make_sandbox(self.options)
        unused = sorted(set(config) & set(BWRAP_ONLY)) if self.options["sandbox"] == "process" else []
        if unused:
            warnings.warn(f"tool 'python': config.{unused[0]} has no effect with sandbox = 'process'; drop it")
        self.schema = config.get("tool_schema") or schema(self.options)

    async def __call__(self, arguments: dict, **sample) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ToolError('the argument "code" must be a string of Python source')
        return await run_code(code, self.options, self.sandbox)


def schema(options: dict) -> dict:
    """The tool's function schema; its description says only what the sandbox enforces."""
    description = DESCRIPTIONS[options["sandbox"]].format(**options)
    code = {"type": "string", "description": "the program to run"}
    parameters = {"type": "object", "properties": {"code": code}, "required": ["code"]}
    return {"type": "function", "function": {"name": "python", "description": description, "parameters": parameters}}


def make_sandbox(options: dict) -> Bwrap | ProcessSandbox:
    """The sandbox `config.sandbox` names, checked by running one call (UserError when this
    machine cannot make it)."""
    kind = options["sandbox"]
    if kind not in SANDBOXES:
        raise UserError(
            f"config.sandbox = {kind!r}: tool 'python' runs code in 'bwrap' (a kernel sandbox, the default) "
            "or 'process' (no boundary, trusted code only)"
        )
    if kind == "process":
        warnings.warn(
            "tool 'python': config.sandbox = 'process' runs the model's code as the trainer's own user, with "
            "the trainer's view of files, processes and network; an in-process tripwire is all that stands in "
            "the way. Use it only for trusted code (docs/agents.md)"
        )
        return ProcessSandbox()
    try:
        sandbox = Bwrap(CHILD)
        _probe(sandbox, options)
    except SandboxUnavailable as exc:
        raise UserError(
            f"config.sandbox = 'bwrap': {exc}; or set config.sandbox = 'process' to run the code without a "
            "sandbox (trusted code only)"
        ) from None
    return sandbox


def _probe(sandbox: Bwrap, options: dict) -> None:
    """Run one call (in a thread of its own: the caller may be inside an event loop)."""
    with ThreadPoolExecutor(1, thread_name_prefix="minirl-sandbox-probe") as pool:
        try:
            text = pool.submit(asyncio.run, run_code("print('ok', end='')", options, sandbox)).result()
        except (ToolError, TimeoutError, OSError) as exc:
            text = str(exc)
    if text != "ok":
        raise SandboxUnavailable(_diagnose(text))


def _diagnose(text: str) -> str:
    """What a failed first call says about the machine, and the fix."""
    line = text.strip().splitlines()[-1] if text.strip() else "no message"
    if "namespace" in line or "uid map" in line or "Operation not permitted" in line:
        return (
            f"the kernel refused the sandbox's namespaces ({line}); allow user namespaces once: `sysctl -w "
            "user.max_user_namespaces=28633`, on Debian 10 or older `sysctl -w kernel.unprivileged_userns_clone=1`, "
            "on Ubuntu 23.10+ `sysctl -w kernel.apparmor_restrict_unprivileged_userns=0`; in a Docker container "
            "run it with `--security-opt seccomp=unconfined --security-opt apparmor=unconfined`"
        )
    if "source path" in line:
        return f"bwrap cannot read the Python runtime ({line}); make that path readable by the trainer's user"
    return f"a first call in the sandbox (print('ok')) failed: {line}; check bwrap and the tool's limits"


async def run_code(code: str, options: dict, sandbox: Bwrap | ProcessSandbox) -> str:
    """Run `code` in a new sandbox; its output as text. Every process it started has ended and
    its working directory is gone when this returns, raises or is cancelled."""
    keys = ("memory_mb", "cpu_s", "file_size_mb", "max_open_files", "max_processes")
    run = await sandbox.start([options[key] for key in keys], options, ENV)
    try:
        out, err = await asyncio.wait_for(_communicate(run.proc, code, options), options["timeout_s"])
    except TimeoutError:
        raise TimeoutError(f"timed out after {options['timeout_s']:g} s") from None
    finally:
        returncode = await run.finish()
    return _result(returncode, out, err, options)


async def _communicate(proc: asyncio.subprocess.Process, code: str, options: dict) -> tuple[str, str]:
    """Send the code, read both streams (each capped) until the sandbox exits."""
    try:
        proc.stdin.write(code.encode("utf-8", "surrogatepass"))
        proc.stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the sandbox failed to start; its stderr says why
    cap = 4 * options["max_output_chars"]  # bytes: enough for that many UTF-8 characters
    out, err, _ = await asyncio.gather(_read_capped(proc.stdout, cap), _read_capped(proc.stderr, cap), proc.wait())
    return out, err


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> str:
    """The stream's first and last `cap` bytes as text, with a marker where bytes were dropped:
    a program printing in a loop until its time runs out must not fill the parent's memory."""
    head, tail, total = bytearray(), bytearray(), 0
    while chunk := await stream.read(1 << 16):
        total += len(chunk)
        room = cap - len(head)
        head += chunk[:room]
        tail += chunk[room:]
        del tail[:-cap]
    dropped = total - len(head) - len(tail)
    marker = f"\n...(truncated {dropped} bytes)...\n" if dropped > 0 else ""
    return head.decode("utf-8", "replace") + marker + tail.decode("utf-8", "replace")


def _result(returncode: int | None, out: str, err: str, options: dict) -> str:
    """The tool message, or a ToolError when the code hit its memory or CPU limit or the sandbox
    did not start (returncode None)."""
    if returncode is None:
        raise ToolError("the sandbox did not start: " + (err.strip().splitlines() or ["no message"])[-1])
    text = out if not err else (out + ("\n" if out and not out.endswith("\n") else "") + err)
    text = truncate(text, options["max_output_chars"], "middle")
    if returncode == -signal.SIGXCPU:
        raise ToolError(f"CPU time limit {options['cpu_s']} s exceeded" + _before(text))
    if returncode == -signal.SIGKILL:  # the hard CPU limit, 1 s after a SIGXCPU the code caught
        limits = f"the CPU time limit {options['cpu_s']} s, or the machine ran out of memory"
        raise ToolError(f"killed by SIGKILL ({limits})" + _before(text))
    if returncode < 0:
        raise ToolError(f"killed by {signal.Signals(-returncode).name}" + _before(text))
    if returncode != 0 and err.rstrip().rpartition("\n")[2].startswith("MemoryError"):
        raise ToolError(f"memory limit {options['memory_mb']} MB exceeded (MemoryError)" + _before(text))
    if returncode != 0 and not err:
        text += f"{chr(10) if text else ''}(exit code {returncode})"
    return text or "(no output)"


def _before(text: str) -> str:
    return f"; output before that:\n{text}" if text else ""


class ProcessSandbox:
    """`sandbox = "process"`: a child process of the trainer in a temporary directory of the host,
    in its own session so that its process group can be killed. No boundary."""

    async def start(self, limits: list[int], options: dict, env: dict) -> ProcessRun:
        workdir = tempfile.mkdtemp(prefix="minirl-python-")
        try:
            argv = [sys.executable, "-I", "-B", str(CHILD), workdir, *map(str, limits[:-1]), "0"]  # no process cap
            proc = await spawn(argv, cwd=workdir, env={**env, "HOME": workdir, "TMPDIR": workdir})
        except BaseException:
            _remove_tree(workdir)
            raise
        return ProcessRun(proc, workdir)


class ProcessRun:
    def __init__(self, proc: asyncio.subprocess.Process, workdir: str):
        self.proc, self.workdir = proc, workdir

    async def finish(self) -> int:
        """Kill the process group (while the child is unreaped, so the group id is still ours),
        wait, delete the directory; the child's return code."""
        if self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        await self.proc.wait()
        _remove_tree(self.workdir)
        return self.proc.returncode


def _remove_tree(path: str) -> None:
    """Delete the working directory, even where the code took away its own permissions."""
    for root, dirs, _ in os.walk(path):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o700)
    shutil.rmtree(path, ignore_errors=True)
