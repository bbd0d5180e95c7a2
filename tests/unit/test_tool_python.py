"""The python tool (plugins/tools/python_exec.py, sandbox_child.py): the model's code must not
write outside its working directory, open a network socket or start processes, and must be
stopped at its wall-clock, memory and CPU limits with a message saying which, leaving no process
and no directory behind. Each test starts one short child process."""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import uuid
from pathlib import Path

import pytest

from minirl.agent.parser import ToolCall
from minirl.agent.tools import ToolEntry, ToolOutcome, ToolSet
from minirl_plugins.tools.python_exec import PythonTool


def run_python(code: str, **config) -> ToolOutcome:
    """One python call through a ToolSet, untruncated by the ToolSet."""
    tools = ToolSet([ToolEntry.of(PythonTool(config))], max_tool_response_length=0)
    try:
        [outcome] = asyncio.run(tools.call_all([ToolCall("python", {"code": code}, "")]))
    finally:
        tools.close()
    return outcome


def test_a_print_comes_back():
    outcome = run_python("print(6 * 7)\nprint('done')")
    assert (outcome.status, outcome.text) == ("ok", "42\ndone\n")


def test_no_output_says_so():
    assert run_python("x = 1").text == "(no output)"


def test_an_exception_shows_the_last_lines_of_its_traceback_only_of_the_users_code():
    outcome = run_python("def f():\n    return 1 / 0\n\nf()")
    assert outcome.status == "ok"  # the code failed, the tool did not
    assert 'File "<code>", line 2, in f' in outcome.text and "return 1 / 0" in outcome.text
    assert outcome.text.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "sandbox_child" not in outcome.text


def test_an_exit_code_without_output_is_reported():
    assert run_python("import sys\nsys.exit(3)").text == "(exit code 3)"


def test_it_cannot_write_outside_its_working_directory():
    name = f"minirl-escape-{uuid.uuid4().hex}"
    target = Path(tempfile.gettempdir()) / name  # the working directory's sibling
    code = f"""
import os, shutil
open("inside.txt", "w").write("fine")
attempts = [
    lambda: open({str(target)!r}, "w"),
    lambda: open("../{name}", "w"),
    lambda: open(os.path.join(os.getcwd(), "..", "{name}"), "a"),
    lambda: os.open("../{name}", os.O_WRONLY | os.O_CREAT),
    lambda: os.mkdir("../{name}"),
    lambda: os.rename("inside.txt", "../{name}"),
    lambda: shutil.copy("inside.txt", "../{name}"),
    lambda: os.symlink("../{name}", "link"),
    lambda: os.link("inside.txt", "../{name}"),
    lambda: os.remove({str(Path(__file__))!r}),
    lambda: os.chdir(".."),
]
for attempt in attempts:
    try:
        attempt()
        print("DONE")
    except PermissionError:
        print("refused")
print(open("inside.txt").read())
"""
    outcome = run_python(code)
    assert outcome.text.split() == ["refused"] * 11 + ["fine"]
    assert not target.exists()
    assert Path(__file__).exists()


def test_it_cannot_open_a_network_socket():
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    code = f"""
import socket
for attempt in (socket.socket, lambda: socket.create_connection(("127.0.0.1", {port}), timeout=1),
                lambda: socket.socket(socket.AF_UNIX).connect("/tmp/x.sock")):
    try:
        attempt()
        print("CONNECTED")
    except PermissionError:
        print("refused")
"""
    try:
        outcome = run_python(code)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    finally:
        listener.close()
    assert outcome.text.split() == ["refused"] * 3


def test_it_cannot_start_processes_or_signal_others():
    code = """
import os, subprocess
for attempt in (lambda: subprocess.run(["true"]), lambda: os.system("true"), os.fork,
                lambda: os.kill(1, 0), lambda: __import__("ctypes").CDLL("libc.so.6")):
    try:
        attempt()
        print("RAN")
    except PermissionError:
        print("refused")
"""
    assert run_python(code).text.split() == ["refused"] * 5


def test_it_is_killed_at_the_wall_clock_limit_and_leaves_no_process(monkeypatch):
    pids = []
    spawn = asyncio.create_subprocess_exec

    async def recording_spawn(*args, **kwargs):
        proc = await spawn(*args, **kwargs)
        pids.append(proc.pid)
        return proc

    monkeypatch.setattr(asyncio, "create_subprocess_exec", recording_spawn)
    outcome = run_python("while True:\n    pass", timeout_s=1, cpu_s=60)
    assert (outcome.status, outcome.text) == ("timeout", 'Error: tool "python" timed out after 1 s')
    assert outcome.latency_s < 10  # killed, not left to its 60 s of CPU
    [pid] = pids
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # the process group, child included, is gone


def test_the_memory_limit_is_a_clear_error():
    outcome = run_python("x = bytearray(2 * 1024 ** 3)", memory_mb=512)
    assert outcome.status == "error"
    assert outcome.text.startswith('Error: tool "python" failed: memory limit 512 MB exceeded (MemoryError)')


def test_the_cpu_limit_is_a_clear_error():
    outcome = run_python("print('start', flush=True)\nwhile True:\n    pass", cpu_s=1, timeout_s=30)
    assert outcome.status == "error"
    assert outcome.text == 'Error: tool "python" failed: CPU time limit 1 s exceeded; output before that:\nstart\n'


def test_long_output_is_cut_in_the_middle():
    outcome = run_python("print('a' * 5000 + 'b' * 5000)", max_output_chars=100)
    assert outcome.text.startswith("a" * 50 + "...(truncated ")
    assert outcome.text.endswith("b" * 49 + "\n")
    assert len(outcome.text) < 150


def test_a_flood_of_output_is_capped_while_it_is_read():
    outcome = run_python("import sys\nsys.stdout.write('y' * 20_000_000)", max_output_chars=100)
    assert outcome.status == "ok"
    assert len(outcome.text) < 150 and "truncated" in outcome.text


def test_the_working_directory_is_fresh_and_removed_afterwards():
    code = "import os\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))\nos.makedirs('a/b')\nos.chmod('a', 0)"
    first, second = run_python(code).text.split("\n")[:2]
    assert Path(first).name.startswith("minirl-python-") and second == "[]"
    assert not Path(first).exists()


def test_the_event_loop_runs_while_the_code_does():
    tools = ToolSet([ToolEntry.of(PythonTool({}))])
    ticks = 0

    async def main():
        nonlocal ticks
        calls = asyncio.ensure_future(
            tools.call_all([ToolCall("python", {"code": "import time\ntime.sleep(0.5)"}, "")])
        )
        while not calls.done():
            ticks += 1
            await asyncio.sleep(0.01)
        return calls.result()

    [outcome] = asyncio.run(main())
    assert outcome.status == "ok" and ticks >= 3
