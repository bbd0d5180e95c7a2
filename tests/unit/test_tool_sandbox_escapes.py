"""Escapes from the python tool's sandbox, tried as a reviewer would (plugins/tools/bwrap.py).

Every attempt first switches the in-process tripwire off from inside (TRIPWIRE_OFF, which proves
it did), so what stops it is the kernel. Each is judged from outside the tool by an effect, never
by the tool's message: a host path that must stay absent or unchanged, a secret the test holds
that must not reach the output, a listener the test opens that must see no connection, a process
of the test's that must stay alive, a process the code started (named so the test can find it in
the host's /proc, and seen there while the call ran) that must be gone when the call returns. The
calls go through ToolSet.call_all, as the agent loop makes them. The seccomp tests are judged by
the errno the kernel answers (what those calls could do would stay in the sandbox's namespaces).
The last tests run some of the same attempts with `sandbox = "process"`, where they do escape:
the checks see an escape when there is one.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from string import Template
from textwrap import dedent, indent

import pytest

from minirl_plugins.tools import seccomp
from minirl_plugins.tools.python_exec import PythonTool
from tests.tool_sandbox import TRIPWIRE_OFF, bound_in_tmp, call, call_watching, mark, name_self, processes_named

REPO = Path(__file__).resolve().parents[2]
SECRET = f"MINIRLSECRET-{uuid.uuid4().hex}"  # held in this process's memory, and in files it writes
MAX_PROCESSES = 8
DISK_MB = 16


@pytest.fixture(scope="module")
def tool():
    """One tool for the module (its start-up probe runs once)."""
    return PythonTool({"timeout_s": 8, "max_processes": MAX_PROCESSES, "disk_mb": DISK_MB})


def program(body: str, **values) -> str:
    """TRIPWIRE_OFF, the usual imports, then `body` (dedented, a string.Template over `values`)
    inside a try that prints any exception: the code goes on to its last line either way."""
    body = Template(dedent(body).strip("\n")).substitute(values)
    return (
        TRIPWIRE_OFF
        + "import os, signal, socket, stat, sys, time\ntry:\n"
        + indent(body, "    ")
        + ("\nexcept Exception as exc:\n    print(repr(exc))\n")
    )


def attempt(tool, body: str, **values) -> str:
    """Run `program(body, **values)` in one call; the tool message (the tripwire was off)."""
    [outcome] = call(tool, program(body, **values))
    assert "TRIPWIRE-OFF" in outcome.text, outcome.text
    return outcome.text


def number_after(text: str, word: str) -> int:
    return int(text.split(word + " ")[1].split()[0])


# ---------------------------------------------------------------------------------------------
# writes outside the working directory: the host path stays absent
# ---------------------------------------------------------------------------------------------

WRITES = {
    "open": "open($target, 'w').write('x')",
    "os_open": "os.close(os.open($target, os.O_CREAT | os.O_WRONLY, 0o644))",
    "makedirs_then_write": """
        os.makedirs(os.path.dirname($target), exist_ok=True)  # inside the sandbox's own /tmp
        open($target, 'w').write('x')
        """,
    "dotdot": "open('../' * 40 + $target.lstrip('/'), 'w').write('x')",
    "sqlite_connect": "import sqlite3\nsqlite3.connect($target).execute('create table t(x)')",
    "sqlite_attach": """
        import sqlite3
        db = sqlite3.connect(':memory:')
        db.execute('ATTACH DATABASE ? AS other', ($target,))
        db.execute('create table other.t(x)')
        """,
    "sqlite_uri": """
        import sqlite3
        sqlite3.connect('file:%s?mode=rwc' % $target, uri=True).execute('create table t(x)')
        """,
    "str_subclass": """
        class Liar(str):
            def startswith(self, *args):
                return True
        open(Liar($target), 'w').write('x')
        """,
    "fspath_switch": """
        class Switch:
            calls = 0
            def __fspath__(self):
                Switch.calls += 1
                return 'inside.txt' if Switch.calls == 1 else $target
        open('inside.txt', 'w').write('x')
        os.rename(Switch(), Switch())
        """,
    "reloaded_posix_mkfifo": "del sys.modules['posix']\nimport posix\nposix.mkfifo($target)",
    "mknod": "del sys.modules['posix']\nimport posix\nposix.mknod($target, 0o600 | stat.S_IFREG)",
    "rename": "open('a', 'w').write('x')\nos.rename('a', $target)",
    "hard_link": "open('a', 'w').write('x')\nos.link('a', $target)",
    "symlink_then_write": "os.symlink($target, 'ln')\nopen('ln', 'w').write('x')",
    "shutil_copy": "import shutil\nopen('a', 'w').write('x')\nshutil.copy('a', $target)",
    "proc_self_root": "open('/proc/self/root' + $target, 'w').write('x')",
    "proc_1_root": "open('/proc/1/root' + $target, 'w').write('x')",
    "subinterpreter": """
        import _xxsubinterpreters as interpreters
        interpreters.run_string(interpreters.create(), 'open(%r, "w").write("x")' % $target)
        """,
    "shell_via_posix_spawn": "os.waitpid(os.posix_spawn('/bin/sh', ['sh', '-c', 'echo x > ' + $target], {}), 0)",
}
TARGETS = {
    "tmp": lambda tmp_path: tmp_path / "escaped",  # the test's own temporary directory
    "venv": lambda tmp_path: Path(sys.prefix) / f"zz_minirl_escape_{uuid.uuid4().hex}.pth",  # run at start-up
    "usr": lambda tmp_path: Path("/usr/local/lib") / f"minirl-escape-{uuid.uuid4().hex}",
    "checkout": lambda tmp_path: REPO / f"minirl-escape-{uuid.uuid4().hex}",
    "dev_shm": lambda tmp_path: Path("/dev/shm") / f"minirl-escape-{uuid.uuid4().hex}",
}
WRITE_CASES = [(way, "tmp") for way in WRITES] + [("open", where) for where in TARGETS if where != "tmp"]


@pytest.mark.parametrize("way, where", WRITE_CASES, ids=[f"{w}-{t}" for w, t in WRITE_CASES])
def test_no_write_reaches_the_host(tool, tmp_path, way, where):
    target = TARGETS[where](tmp_path)
    try:
        attempt(tool, WRITES[way], target=repr(str(target)))
        assert not os.path.lexists(target)
        assert list(tmp_path.iterdir()) == []
    finally:
        if os.path.lexists(target):
            os.remove(target)


def test_shm_open_leaves_nothing_in_the_hosts_dev_shm(tool):
    name = f"minirl-escape-{uuid.uuid4().hex}"
    attempt(
        tool, "import _posixshmem\n_posixshmem.shm_open($name, os.O_CREAT | os.O_RDWR, 0o600)", name=repr("/" + name)
    )
    assert not (Path("/dev/shm") / name).exists()


CHANGES = {
    "chmod": "os.chmod($path, 0o777)",
    "utime": "os.utime($path, (0, 0))",
    "truncate": "os.truncate($path, 0)",
    "open_trunc": "open($path, 'w').write('changed')",
    "append": "open($path, 'a').write('changed')",
    "remove": "os.remove($path)",
    "rename_over": "open('b', 'w').write('changed')\nos.rename('b', $path)",
}


@pytest.fixture
def visible_file():
    """A host file the sandbox can see (in the virtual environment, bound read-only)."""
    path = Path(sys.prefix) / f"minirl-visible-{uuid.uuid4().hex}.txt"
    path.write_text("original")
    path.chmod(0o644)
    yield path
    path.unlink(missing_ok=True)


@pytest.mark.parametrize("way", CHANGES)
def test_a_host_file_in_view_stays_unchanged(tool, visible_file, way):
    before = visible_file.stat()
    text = attempt(tool, "print(open($path).read())\n" + CHANGES[way], path=repr(str(visible_file)))
    assert text.splitlines()[1] == "original"  # it could read it: the file was in view
    after = visible_file.stat()
    assert visible_file.read_text() == "original"
    assert (after.st_mode, after.st_mtime_ns, after.st_size) == (before.st_mode, before.st_mtime_ns, before.st_size)


# ---------------------------------------------------------------------------------------------
# reads: a secret of the host's or the trainer's never reaches the output
# ---------------------------------------------------------------------------------------------

SCAN = """
    import re
    pattern = re.compile(rb'MINIRL' + rb'SECRET-[0-9a-f]{32}')
    found = set()
    def scan(path, limit=1 << 26):
        try:
            with open(path, 'rb') as f:
                found.update(pattern.findall(f.read(limit)))
        except OSError:
            pass
    """
READS = {
    "environ_of_every_process": """
        for p in os.listdir('/proc'):
            scan(f'/proc/{p}/environ')
        found.update(pattern.findall(repr(os.environ).encode()))
        """,
    "memory_of_every_process": """
        # the known pids first, and stop at the first find: a busy host has hundreds of
        # processes, and scanning them all outlasted the control's 5 s CPU limit
        for p in [$me, $holder] + [p for p in os.listdir('/proc') if p.isdigit()]:
            if found:
                break
            try:
                maps = open(f'/proc/{p}/maps').read().splitlines()
                mem = open(f'/proc/{p}/mem', 'rb')
            except OSError:
                continue
            for line in maps:
                low, high = (int(x, 16) for x in line.split()[0].split('-'))
                try:
                    if high - low < 1 << 26:
                        mem.seek(low)
                        found.update(pattern.findall(mem.read(high - low)))
                except (OSError, ValueError, OverflowError):
                    pass
        """,
    "trainer_by_host_pid": """
        for pid in ($me, $holder):
            for name in ('environ', 'cmdline', 'mem'):
                scan(f'/proc/{pid}/{name}')
        """,
    "cwd_of_every_process": """
        for p in os.listdir('/proc'):
            scan(f'/proc/{p}/cwd/secret.txt')
        scan($cwd + '/secret.txt')
        scan('../' * 40 + $cwd.lstrip('/') + '/secret.txt')
        """,
    "whole_file_tree": """
        skip = {'/proc', '/dev', '/usr', sys.prefix, sys.base_prefix}  # the runtime, devices, processes
        for root, dirs, files in os.walk('/'):
            dirs[:] = [d for d in dirs if os.path.join(root, d) not in skip]
            for f in files:
                scan(os.path.join(root, f), 1 << 20)
        """,
    "root_and_cwd_of_every_process": """
        for p in os.listdir('/proc'):
            scan(f'/proc/{p}/root/tmp/secret.txt')
            scan(f'/proc/{p}/cwd/secret.txt')
        """,
    "host_dev_shm": """
        for f in os.listdir('/dev/shm'):
            scan('/dev/shm/' + f)
        scan($shm)
        """,
}


def reading(*ways: str) -> str:
    """A search of READS[way] for each way, printing the secrets it found."""
    return dedent(SCAN) + "".join(dedent(READS[way]) for way in ways) + "print('found', sorted(found))"


@pytest.fixture
def secrets(tmp_path, monkeypatch):
    """SECRET in the environment of a process of the test's (a process's /proc environ is the one
    it started with), in this one's memory, in a file of the current directory, in /dev/shm."""
    holder = subprocess.Popen(["sleep", "60"], env={**os.environ, "MINIRL_TEST_SECRET": SECRET})
    (tmp_path / "secret.txt").write_text(SECRET)
    monkeypatch.chdir(tmp_path)
    shm = Path("/dev/shm") / f"minirl-secret-{uuid.uuid4().hex}"
    shm.write_text(SECRET)
    yield {"me": os.getpid(), "holder": holder.pid, "cwd": repr(str(tmp_path)), "shm": repr(str(shm))}
    shm.unlink()
    holder.kill()
    holder.wait()


@pytest.mark.parametrize("way", READS)
def test_no_secret_of_the_trainer_or_host_is_read(tool, secrets, way):
    text = attempt(tool, reading(way), **secrets)
    assert "found []" in text and SECRET not in text


def test_etc_shadow_is_not_in_view(tool):
    shadow = Path("/etc/shadow")
    first_line = shadow.read_text().splitlines()[0] if os.access(shadow, os.R_OK) else "root:"
    body = """
        for p in ('/etc/shadow', '/proc/1/root/etc/shadow', '../' * 40 + 'etc/shadow'):
            try:
                print(open(p).read())
            except OSError as e:
                print(e)
        """
    text = attempt(tool, body)
    assert first_line not in text and "root:" not in text


def test_the_checkout_is_not_in_view(tool):
    text = attempt(tool, "print(open($path).read())", path=repr(str(REPO / "pyproject.toml")))
    assert "minirl is layered by the step" not in text


def test_the_hosts_name_is_not_in_view(tool):
    text = attempt(tool, "print(socket.gethostname(), os.uname().nodename)\nprint(open('/etc/hostname').read())")
    assert text.splitlines()[1] == "sandbox sandbox"
    assert socket.gethostname() not in text.replace("sandbox", "")


def test_a_concurrent_call_cannot_read_the_others_directory(tool):
    """Two calls of one turn at once: the first keeps a secret in its directory while the second
    searches every place it can see."""
    keeper = "open('secret.txt', 'w').write('MINIRL' + 'SECRET-' + '0' * 32)\ntime.sleep(1.5)\n"
    keeper += "print(open('secret.txt').read())"
    seeker = "time.sleep(0.5)\n" + reading("whole_file_tree", "root_and_cwd_of_every_process")
    kept, sought = call(tool, program(keeper), program(seeker))
    assert kept.text.endswith("MINIRLSECRET-" + "0" * 32 + "\n")
    assert "found []" in sought.text


# ---------------------------------------------------------------------------------------------
# processes: whatever the code starts is gone when the call returns or times out
# ---------------------------------------------------------------------------------------------

SURVIVORS = {
    "fork_then_return": """
        if os.fork() == 0:
            $name_self
            time.sleep(60)
        time.sleep(0.5)
        """,
    "setsid_daemon_then_return": """
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                signal.signal(signal.SIGHUP, signal.SIG_IGN)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                $name_self
                time.sleep(60)
            os._exit(0)
        time.sleep(0.5)
        """,
    "own_process_group_then_exit": """
        if os.fork() == 0:
            os.setpgid(0, 0)
            $name_self
            time.sleep(60)
        time.sleep(0.5)
        os._exit(0)
        """,
    "fork_exec_under_another_name": """
        import importlib.util, subprocess
        spec = importlib.util.find_spec('_posixsubprocess')
        renamed = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(renamed)
        subprocess._fork_exec = renamed.fork_exec
        subprocess.Popen([sys.executable, '-c', $child])
        time.sleep(1)
        """,
    "posix_spawn": "os.posix_spawn(sys.executable, [sys.executable, '-c', $child], {})\ntime.sleep(1)",
}


@pytest.mark.parametrize("way", SURVIVORS)
def test_no_process_outlives_a_call_that_returns(tool, way):
    name = mark()
    child = f"import time\n{name_self(name)}\ntime.sleep(60)"
    outcome, seen = call_watching(tool, program(SURVIVORS[way], name_self=name_self(name), child=repr(child)), name)
    assert "TRIPWIRE-OFF" in outcome.text and outcome.status == "ok", outcome.text
    assert seen, "the code's process never ran"
    assert processes_named(name) == []


def test_no_process_outlives_a_call_that_times_out():
    name = mark()
    body = SURVIVORS["setsid_daemon_then_return"].replace("time.sleep(0.5)", "time.sleep(60)")
    outcome, seen = call_watching(PythonTool({"timeout_s": 1.5}), program(body, name_self=name_self(name)), name)
    assert outcome.status == "timeout" and seen
    assert processes_named(name) == []


def test_the_code_runs_unprivileged_as_seen_from_the_host(tool):
    """From the host's /proc: no capabilities, no_new_privs, a seccomp filter, and (the trainer
    being root) the host's uid 65534, never the trainer's own uid."""
    name = mark()
    keys = ("Uid", "CapEff", "CapPrm", "NoNewPrivs", "Seccomp")
    _, [fields] = call_watching(tool, program(f"{name_self(name)}\ntime.sleep(0.5)"), name, keys)
    assert [fields[key] for key in keys[1:]] == ["0" * 16, "0" * 16, "1", "2"]
    assert fields["Uid"] == ("65534" if os.geteuid() == 0 else str(os.getuid()))


def test_a_fork_bomb_stops_at_the_process_cap(tool):
    name = mark()
    body = """
        n = 0
        for _ in range(500):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                $name_self
                time.sleep(60)
            n += 1
        print('forked', n)
        time.sleep(0.5)
        """
    outcome, seen = call_watching(tool, program(body, name_self=name_self(name)), name)
    forked = number_after(outcome.text, "forked")
    assert 0 < forked < MAX_PROCESSES and len(seen) == forked
    assert processes_named(name) == []
    assert subprocess.run(["true"]).returncode == 0  # the machine still starts processes


def test_a_thread_bomb_stops_at_the_process_cap(tool):
    body = """
        import threading
        n = 0
        for _ in range(500):
            try:
                threading.Thread(target=time.sleep, args=(2,), daemon=True).start()
            except RuntimeError:
                break
            n += 1
        print('threads', n)
        """
    assert 0 < number_after(attempt(tool, body), "threads") < MAX_PROCESSES


# ---------------------------------------------------------------------------------------------
# the trainer and the test's own processes: never signalled, traced or read
# ---------------------------------------------------------------------------------------------

SIGNALS = {
    "kill_parent": "os.kill(os.getppid(), 9)",
    "kill_everything": "os.kill(-1, 9)",
    "kill_by_host_pid": "os.kill($victim, 9)",
    "kill_process_group": "os.killpg($victim, 9)",
    "pidfd_of_parent": "signal.pidfd_send_signal(os.pidfd_open(os.getppid()), 9)",
    "pidfd_by_host_pid": "signal.pidfd_send_signal(os.pidfd_open($victim), 9)",
    "ptrace_attach": """
        import ctypes
        print(ctypes.CDLL(None, use_errno=True).ptrace(16, $victim, 0, 0), ctypes.get_errno())
        """,
}


@pytest.fixture
def victim():
    """A process of the test's, the trainer's stand-in next to the test process itself."""
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def untouched(proc: subprocess.Popen) -> bool:
    """Alive and not stopped (by a signal or a tracer)."""
    return proc.poll() is None and Path(f"/proc/{proc.pid}/stat").read_text().rpartition(")")[2].split()[0] == "S"


@pytest.mark.parametrize("way", SIGNALS)
def test_the_trainer_cannot_be_signalled_or_traced(tool, victim, way):
    body = (
        "try:\n" + indent(dedent(SIGNALS[way]).strip(), "    ") + "\nexcept OSError as e:\n    print(e)\nprint('after')"
    )
    text = attempt(tool, body, victim=victim.pid)
    assert untouched(victim)  # and this test, the trainer, is alive to check
    assert "after" in text  # PID 1 of the sandbox, killed from inside, would have ended the call


def test_the_trainer_survives_the_rebound_getpid_trick_with_the_tripwire_armed(tool, victim):
    """The tripwire lets a process signal itself; rebinding os.getpid made it signal the parent."""
    code = f"""
        import os
        for pid in (os.getppid(), {victim.pid}):
            os.getpid = lambda: pid
            try:
                os.kill(pid, 9)
            except OSError as e:
                print(e)
        print('after')
        """
    [outcome] = call(tool, dedent(code))
    assert untouched(victim) and "after" in outcome.text


# ---------------------------------------------------------------------------------------------
# network: no connection reaches a listener the test opens
# ---------------------------------------------------------------------------------------------


def host_address() -> str:
    """This machine's address on its network (not loopback), or 127.0.0.1 when it has none."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.255", 9))  # sends nothing: it only picks the outgoing interface
        return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        probe.close()


CONNECT = "s = socket.socket($family, socket.SOCK_STREAM)\ns.settimeout(1)\ns.connect($address)\nprint('CONNECTED')"
LO_UP = """
    import fcntl, struct
    try:
        fcntl.ioctl(socket.socket(), 0x8914, struct.pack('16sH22x', b'lo', 1))  # SIOCSIFFLAGS: lo up
    except OSError as e:
        print('ioctl', e)
    """


def ipv6_loopback() -> tuple[int, tuple]:
    """::1 where the machine has IPv6, else 127.0.0.1 (containers may have IPv6 off)."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return socket.AF_INET, ("127.0.0.1", 0)
    return socket.AF_INET6, ("::1", 0)


def loopback() -> tuple[int, tuple]:
    return socket.AF_INET, ("127.0.0.1", 0)


NETWORK = {  # way: (where the listener binds: family and address, the attempt)
    "tcp_loopback": (loopback, CONNECT),
    "tcp_host_address": (lambda: (socket.AF_INET, (host_address(), 0)), CONNECT),
    "tcp_ipv6_loopback": (ipv6_loopback, CONNECT),
    "http": (loopback, "import urllib.request\nurllib.request.urlopen('http://%s:%d/' % $address, timeout=1)"),
    "loopback_brought_up_first": (loopback, dedent(LO_UP) + CONNECT),
    "unix_socket_path": (lambda: (socket.AF_UNIX, None), CONNECT),
    "abstract_unix_socket": (lambda: (socket.AF_UNIX, f"\0minirl-{uuid.uuid4().hex}"), CONNECT),
}


@pytest.mark.parametrize("way", NETWORK)
def test_no_connection_reaches_a_listener_of_the_host(tool, tmp_path, way):
    where, body = NETWORK[way]
    family, bind_to = where()
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.bind(bind_to or str(tmp_path / "listener.sock"))
    listener.listen()
    listener.setblocking(False)
    address = listener.getsockname()
    try:
        text = attempt(
            tool, body, family=int(family), address=repr(address[:2] if isinstance(address, tuple) else address)
        )
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    finally:
        listener.close()
    assert "CONNECTED" not in text


def test_no_datagram_reaches_the_host(tool):
    receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    receiver.bind(("127.0.0.1", 0))
    receiver.setblocking(False)
    try:
        attempt(
            tool,
            "socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', $address)",
            address=repr(receiver.getsockname()),
        )
        with pytest.raises(BlockingIOError):
            receiver.recvfrom(16)
    finally:
        receiver.close()


# ---------------------------------------------------------------------------------------------
# resources and clean-up
# ---------------------------------------------------------------------------------------------


def test_the_disk_quota_stops_a_disk_fill(tool):
    """16 files of 16 MB into a 16 MB tmpfs (in memory: the host's disks see nothing of it)."""
    body = """
        written = 0
        try:
            for i in range(16):
                with open(f'f{i}', 'wb') as f:
                    for _ in range(16):
                        f.write(b'x' * (1 << 20))
                        written += 1
        finally:
            print('written', written)
        """
    assert 0 < number_after(attempt(tool, body), "written") <= DISK_MB


def test_nested_directories_do_not_defeat_the_clean_up(tool):
    """1,500 nested directories, the outer one made unreadable: the tmpfs goes with the sandbox,
    the next call's directory is empty and nothing is left in the host's temporary directory."""
    before = {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("minirl")}
    body = """
        path = '.'
        for i in range(1500):
            path += '/d'
            os.mkdir(path)
        os.chmod('d', 0)
        print('made')
        """
    assert "made" in attempt(tool, body)
    assert attempt(tool, "print(os.listdir('.'))").endswith(f"{bound_in_tmp()}\n")
    assert {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("minirl")} == before


def test_open_files_are_capped(tool):
    body = """
        kept = []
        try:
            while len(kept) < 10000:
                kept.append(open('/dev/null'))
        finally:
            print('opened', len(kept))
        """
    assert number_after(attempt(tool, body), "opened") < 64


# ---------------------------------------------------------------------------------------------
# the tripwire switched off in each known way: writes, network, signals, survivors all contained
# ---------------------------------------------------------------------------------------------

SWITCH_OFF = {
    "gc": TRIPWIRE_OFF,
    "main_module": "import __main__\n__main__.Tripwire.__call__ = lambda self, event, args: None\n",
    "frame_globals": dedent(
        """
        import sys
        frame = sys._getframe()
        while frame:
            if 'Tripwire' in frame.f_globals:
                frame.f_globals['Tripwire'].__call__ = lambda self, event, args: None
            frame = frame.f_back
        """
    ),
}
BATTERY = """
import os, socket, time
for step in (
    lambda: open($target, 'w').write('x'),
    lambda: socket.create_connection(('127.0.0.1', $port), timeout=1),
    lambda: os.kill($victim, 9),
    lambda: os.kill(os.getppid(), 9),
):
    try:
        step()
    except OSError as e:
        print(e)
if os.fork() == 0:
    os.setsid()
    $name_self
    time.sleep(60)
time.sleep(0.5)
"""


@pytest.mark.parametrize("way", SWITCH_OFF)
def test_with_the_tripwire_switched_off_nothing_escapes(tool, tmp_path, victim, way):
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    name, target = mark(), tmp_path / "escaped"
    values = {"target": repr(str(target)), "port": listener.getsockname()[1], "victim": victim.pid}
    try:
        outcome, seen = call_watching(
            tool, SWITCH_OFF[way] + Template(BATTERY).substitute(values, name_self=name_self(name)), name
        )
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()
    assert "not allowed in the python tool" not in outcome.text  # the tripwire was off: the kernel refused
    assert seen and processes_named(name) == []
    assert not target.exists() and untouched(victim)


def test_a_rebound_realpath_gets_past_the_tripwire_but_not_to_the_host(tool, tmp_path):
    """With os.path.realpath answering the working directory, the armed tripwire sees every path
    inside and lets the write through: the mount namespace still has no such host path."""
    target = tmp_path / "escaped"
    code = f"""
        import os
        os.path.realpath = lambda path, **kwargs: '/tmp'
        try:
            open({str(target)!r}, 'w')
        except OSError as e:
            print(repr(e))
        """
    [outcome] = call(tool, dedent(code))
    assert outcome.text.startswith("FileNotFoundError") and not target.exists()


# ---------------------------------------------------------------------------------------------
# the kernel's second layer: system calls the seccomp filter refuses
# ---------------------------------------------------------------------------------------------

NEWUSER, SIGCHLD = 0x10000000, 17
REFUSED_CALLS = {  # name: (arguments, the errno expected)
    "unshare": ((NEWUSER,), "EPERM"),
    "setns": ((0, 0), "EPERM"),
    "clone": ((NEWUSER | SIGCHLD, 0, 0, 0, 0), "EPERM"),
    "clone3": ((0, 0), "ENOSYS"),
    "mount": ((b"none", b"/tmp", b"tmpfs", 0, 0), "EPERM"),
    "ptrace": ((0, 0, 0, 0), "EPERM"),  # PTRACE_TRACEME
    "process_vm_readv": ((1, 0, 0, 0, 0, 0), "EPERM"),
    "bpf": ((0, 0, 0), "EPERM"),
    "perf_event_open": ((0, 0, -1, -1, 0), "EPERM"),
    "keyctl": ((0, 0), "EPERM"),
    "userfaultfd": ((0,), "EPERM"),
    "io_uring_setup": ((1, 0), "EPERM"),
    "open_by_handle_at": ((0, 0, 0), "EPERM"),
}


@pytest.mark.parametrize("name", REFUSED_CALLS)
def test_the_seccomp_filter_refuses(tool, name):
    args, expected = REFUSED_CALLS[name]
    number = seccomp.SYSCALLS[name][0 if platform.machine() == "x86_64" else 1]
    body = f"""
        import ctypes, errno
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        result = libc.syscall({number}, *{args!r})
        print('errno', errno.errorcode.get(ctypes.get_errno()) if result < 0 else result)
        """
    assert attempt(tool, body).splitlines()[-1] == f"errno {expected}"


@pytest.mark.parametrize("family", ["AF_VSOCK", "AF_NETLINK", "AF_PACKET", "AF_ALG"])
def test_sockets_outside_the_network_namespace_are_refused(tool, family):
    """AF_VSOCK is not namespaced: it reaches the hypervisor of a virtual machine like this one."""
    text = attempt(tool, f"socket.socket(socket.{family}, socket.SOCK_SEQPACKET)\nprint('made')")
    assert text.splitlines()[-1].startswith("OSError(97,")  # EAFNOSUPPORT


# ---------------------------------------------------------------------------------------------
# controls: with `sandbox = "process"` the same attempts escape, so the checks do see escapes
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def unboxed():
    with pytest.warns(UserWarning, match="sandbox = 'process'"):
        return PythonTool({"sandbox": "process", "timeout_s": 8})


def test_control_a_write_escapes_without_the_sandbox(unboxed, tmp_path):
    target = tmp_path / "escaped"
    attempt(unboxed, WRITES["sqlite_attach"], target=repr(str(target)))
    assert target.exists()


@pytest.mark.parametrize("way", [way for way in READS if way != "whole_file_tree"])
def test_control_a_secret_is_read_without_the_sandbox(unboxed, secrets, way):
    assert SECRET in attempt(unboxed, reading(way), **secrets)


def test_control_a_connection_escapes_without_the_sandbox(unboxed):
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(1)
    try:
        attempt(unboxed, "socket.create_connection($address, timeout=1)", address=repr(listener.getsockname()))
        listener.accept()[0].close()  # it arrived
    finally:
        listener.close()


def test_control_the_trainer_is_signalled_without_the_sandbox(unboxed, victim):
    attempt(unboxed, SIGNALS["kill_by_host_pid"], victim=victim.pid)
    assert victim.wait(timeout=5) == -9


def test_control_a_process_outlives_the_call_without_the_sandbox(unboxed):
    name = mark()
    body = """
        if os.fork() == 0:
            os.setsid()
            os.close(1)
            os.close(2)
            $name_self
            time.sleep(5)
            os._exit(0)
        time.sleep(0.5)
        """
    _, seen = call_watching(unboxed, program(body, name_self=name_self(name)), name)
    survivors = processes_named(name)
    for pid in survivors:
        os.kill(pid, 9)
    assert seen and survivors
