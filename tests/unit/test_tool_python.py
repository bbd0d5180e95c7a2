"""The python tool (plugins/tools/python_exec.py, bwrap.py, sandbox_child.py) as the model uses
it: output, tracebacks and exit codes come back; the wall-clock, memory and CPU limits stop the
code with a message saying which; the tripwire inside refuses the obvious escapes with a message;
calls run concurrently; a machine that cannot make the sandbox fails the tool's start with one
line naming the fix; `sandbox = "process"` warns. The kernel boundary itself is tested, escape by
escape, in test_tool_sandbox_escapes.py. Each test starts one or two short sandboxes."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from pathlib import Path

import pytest

from minirl.agent.parser import ToolCall
from minirl.agent.tools import ToolEntry, ToolOutcome, ToolSet
from minirl.errors import UserError
from minirl_plugins.tools import bwrap
from minirl_plugins.tools.python_exec import PythonTool
from tests.tool_sandbox import TRIPWIRE_OFF, bound_in_tmp, call, call_watching, mark, name_self, processes_named


def run_python(code: str, **config) -> ToolOutcome:
    """One python call through a ToolSet, untruncated by the ToolSet."""
    [outcome] = call(PythonTool(config), code)
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


def test_the_tripwire_refuses_writes_outside_its_working_directory_with_a_message():
    """The tripwire (the audit hook inside) stops the obvious attempts early, with a message the
    model can read; the kernel boundary behind it is tested in test_tool_sandbox_escapes.py."""
    name = f"minirl-escape-{uuid.uuid4().hex}"
    keep = Path("/var/tmp") / f"{name}-keep"  # a host file outside /tmp, where a checkout may live
    keep.write_text("host")
    code = f"""
import os, shutil
open("inside.txt", "w").write("fine")
attempts = [
    lambda: open("/var/tmp/{name}", "w"),
    lambda: open("../{name}", "w"),
    lambda: open(os.path.join(os.getcwd(), "..", "{name}"), "a"),
    lambda: os.open("../{name}", os.O_WRONLY | os.O_CREAT),
    lambda: os.mkdir("../{name}"),
    lambda: os.rename("inside.txt", "../{name}"),
    lambda: shutil.copy("inside.txt", "../{name}"),
    lambda: os.symlink("../{name}", "link"),
    lambda: os.link("inside.txt", "../{name}"),
    lambda: os.remove({str(keep)!r}),
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
    try:
        outcome = run_python(code)
        assert outcome.text.split() == ["refused"] * 11 + ["fine"]
        assert not (Path("/var/tmp") / name).exists()
        assert keep.read_text() == "host"
    finally:
        keep.unlink(missing_ok=True)


def test_the_tripwire_refuses_network_sockets_with_a_message():
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


def test_the_tripwire_refuses_processes_signals_and_ctypes_with_a_message():
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


def test_it_is_killed_at_the_wall_clock_limit_and_leaves_no_process():
    name = mark()
    code = TRIPWIRE_OFF + name_self(name) + "\nwhile True:\n    pass"  # naming itself takes ctypes
    outcome, seen = call_watching(PythonTool({"timeout_s": 1, "cpu_s": 60}), code, name)
    assert (outcome.status, outcome.text) == ("timeout", 'Error: tool "python" timed out after 1 s')
    assert outcome.latency_s < 10  # killed, not left to its 60 s of CPU
    assert seen and processes_named(name) == []  # it ran, and it is gone


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


def test_the_working_directory_is_fresh_in_every_call():
    code = "import os\nprint(os.getcwd(), sorted(os.listdir('.')))\nopen('left', 'w').write('x')\nos.makedirs('a/b')"
    tool = PythonTool({})
    first, second = call(tool, code)[0], call(tool, code)[0]
    assert first.text == second.text == f"/tmp {bound_in_tmp()}\n"


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


def test_calls_of_one_turn_run_concurrently():
    """Two calls of a turn (or of two samples) each sleep 1 s; together they take well under 2 s."""
    tool = PythonTool({})
    start = time.perf_counter()
    outcomes = call(tool, "import time\ntime.sleep(1)\nprint('a')", "import time\ntime.sleep(1)\nprint('b')")
    assert [o.text for o in outcomes] == ["a\n", "b\n"]
    assert time.perf_counter() - start < 1.8


def test_the_description_says_only_what_the_sandbox_enforces():
    boxed = PythonTool({"disk_mb": 32}).schema["function"]["description"]
    assert "no network" in boxed and "/tmp (at most 32 MB" in boxed
    with pytest.warns(UserWarning, match="sandbox = 'process' runs the model's code as the trainer's own user"):
        plain = PythonTool({"sandbox": "process"}).schema["function"]["description"]
    assert "network" not in plain and "directory" not in plain


def test_the_process_mode_still_runs_code_in_a_directory_it_removes():
    code = "import os\nprint(os.getcwd())\nos.makedirs('a/b')\nos.chmod('a', 0)"
    with pytest.warns(UserWarning):
        outcome = run_python(code, sandbox="process")
    assert Path(outcome.text.strip()).name.startswith("minirl-python-")
    assert not Path(outcome.text.strip()).exists()


def test_an_unknown_sandbox_names_the_choices():
    with pytest.raises(UserError, match=r"config.sandbox = 'docker': tool 'python' runs code in 'bwrap' .* 'process'"):
        PythonTool({"sandbox": "docker"})


def fake_bwrap(tmp_path, monkeypatch, version: str, message: str) -> None:
    """A `bwrap` on PATH that reports `version` and fails every sandbox with `message`."""
    script = tmp_path / "bwrap"
    script.write_text(f'#!/bin/sh\n[ "$1" = --version ] && echo "{version}" && exit 0\necho "{message}" >&2\nexit 1\n')
    script.chmod(0o755)
    monkeypatch.setattr(bwrap.shutil, "which", lambda name: str(script))


def test_without_bwrap_the_tool_refuses_to_start_and_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(bwrap.shutil, "which", lambda name: None)
    monkeypatch.setattr(bwrap.os, "access", lambda path, mode: False)
    with pytest.raises(UserError) as error:
        PythonTool({})
    message = str(error.value)
    assert "\n" not in message and "bubblewrap (bwrap) is not installed" in message
    assert "apt-get install bubblewrap" in message and "config.sandbox = 'process'" in message


def test_a_kernel_without_user_namespaces_is_named_with_the_sysctl(tmp_path, monkeypatch):
    refusal = "bwrap: No permissions to creating new namespace, likely because the kernel does not allow it"
    fake_bwrap(tmp_path, monkeypatch, "bubblewrap 0.8.0", refusal)
    with pytest.raises(UserError) as error:
        PythonTool({})
    message = str(error.value)
    assert "\n" not in message and "the kernel refused the sandbox's namespaces" in message
    assert "sysctl -w user.max_user_namespaces" in message and refusal in message


def test_a_bwrap_too_old_for_the_disk_quota_is_refused(tmp_path, monkeypatch):
    fake_bwrap(tmp_path, monkeypatch, "bubblewrap 0.6.1", "")
    with pytest.raises(UserError, match=r"bubblewrap 0.6.1; the sandbox needs bubblewrap 0.7 or newer"):
        PythonTool({})


def test_a_limit_only_the_sandbox_enforces_warns_in_process_mode():
    with pytest.warns(UserWarning) as warned:
        PythonTool({"sandbox": "process", "disk_mb": 8})
    assert "config.disk_mb has no effect with sandbox = 'process'; drop it" in str(warned[-1].message)
