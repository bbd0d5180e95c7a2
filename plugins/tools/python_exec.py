"""python: runs the model's code in a separate, limited process and returns what it printed.

Each call gets a fresh temporary working directory (deleted afterwards) and a child process
(`python -I -B sandbox_child.py`, in its own session so that the whole process group can be
killed) with stdin closed, a minimal environment, and resource limits set in the child: address
space (memory_mb), CPU seconds (cpu_s), file size (file_size_mb) and open files (max_open_files).
A wall-clock limit (timeout_s) kills the group. Inside the child an audit hook refuses network
sockets, writes outside the working directory, new processes and ctypes; sandbox_child.py lists
what it refuses and where it stops.

The tool message is stdout then stderr (an exception's traceback), cut to max_output_chars
(the middle goes, so the start of the output and the end of a traceback stay). Hitting the memory
or CPU limit is a ToolError that says which; the wall-clock limit raises TimeoutError, which the
ToolSet reports as a timeout. The process runs under asyncio, so the event loop (and every other
sample's decoding) keeps going while it does.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from minirl.agent.tools import ToolError, tool_options, truncate

CHILD = Path(__file__).with_name("sandbox_child.py")
DEFAULTS = {
    "timeout_s": 10.0,
    "memory_mb": 512,
    "cpu_s": 5,
    "file_size_mb": 16,
    "max_open_files": 64,
    "max_output_chars": 4096,
}
SCHEMA = {
    "type": "function",
    "function": {
        "name": "python",
        "description": (
            "Run Python 3 code in a fresh process and return what it prints (stdout, then stderr). "
            "No network; files only in the current directory; limited time and memory. print() the "
            "values you want to see."
        ),
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the program to run"}},
            "required": ["code"],
        },
    },
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
        self.schema = config.get("tool_schema") or SCHEMA

    async def __call__(self, arguments: dict, **sample) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ToolError('the argument "code" must be a string of Python source')
        return await run_code(code, self.options)


async def run_code(code: str, options: dict) -> str:
    """Run `code` in a limited child process in a throw-away directory; its output as text."""
    workdir = tempfile.mkdtemp(prefix="minirl-python-")
    try:
        proc = await _spawn(workdir, options)
        try:
            out, err = await asyncio.wait_for(_communicate(proc, code, options), options["timeout_s"])
        except TimeoutError:
            raise TimeoutError(f"timed out after {options['timeout_s']:g} s") from None
        finally:
            _kill_group(proc)
            await proc.wait()
    finally:
        _remove_tree(workdir)
    return _result(proc.returncode, out, err, options)


async def _spawn(workdir: str, options: dict) -> asyncio.subprocess.Process:
    limits = [options[key] for key in ("memory_mb", "cpu_s", "file_size_mb", "max_open_files")]
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-I",
        "-B",
        str(CHILD),
        workdir,
        *map(str, limits),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=workdir,
        env={**ENV, "HOME": workdir, "TMPDIR": workdir},
        start_new_session=True,
    )


async def _communicate(proc: asyncio.subprocess.Process, code: str, options: dict) -> tuple[str, str]:
    """Send the code, read both streams (each capped) until the child exits."""
    proc.stdin.write(code.encode("utf-8", "surrogatepass"))
    proc.stdin.close()
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


def _result(returncode: int, out: str, err: str, options: dict) -> str:
    """The tool message, or a ToolError when the child hit its memory or CPU limit."""
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


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    """Kill the child's process group while the child is unreaped (so the group id is still ours)."""
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _remove_tree(path: str) -> None:
    """Delete the working directory, even where the code took away its own permissions."""
    for root, dirs, _ in os.walk(path):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o700)
    shutil.rmtree(path, ignore_errors=True)
