"""The child side of the python tool: limits itself, installs a guard, runs the code from stdin.

Run as `python -I -B sandbox_child.py WORKDIR MEMORY_MB CPU_S FILE_MB MAX_FILES` with the code on
stdin and WORKDIR as the working directory; python_exec.py does this. Standard library only: it
must not import minirl (torch would blow the memory limit and cost seconds per call).

Order matters: read the code, close stdin, set the resource limits, disarm what the guard cannot
see, install the audit hook, run. The guard (a sys.addaudithook hook) refuses network sockets,
writes and file changes outside WORKDIR, starting processes, signalling other processes, raising
limits, foreign-function calls (ctypes) and loading native code from outside the Python install.
It stops accidents and the obvious escapes of model-written code; it is not a security boundary
against code crafted to break out of CPython (bytecode built by hand and loaded with marshal can
still corrupt the interpreter's memory): run untrusted work inside a container for that.
"""

import linecache
import os
import posix
import resource
import signal
import socket
import sys
import traceback

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
REFUSED_EVENTS = frozenset(
    "os.fork os.forkpty os.exec os.spawn os.posix_spawn os.system os.startfile os.killpg subprocess.Popen "
    "pty.spawn resource.setrlimit resource.prlimit sys.addaudithook "
    "sqlite3.enable_load_extension sqlite3.load_extension".split()
)
# path-changing events -> the positions of their path arguments (an int there is an fd)
PATH_EVENTS = {
    "os.remove": (0,),
    "os.rmdir": (0,),
    "os.mkdir": (0,),
    "os.rename": (0, 1),
    "os.link": (0, 1),
    "os.chmod": (0,),
    "os.chown": (0,),
    "os.utime": (0,),
    "os.truncate": (0,),
    "os.setxattr": (0,),
    "os.removexattr": (0,),
    "os.chflags": (0,),
    "os.lchflags": (0,),
    "shutil.chown": (0,),
}
# native modules that write files, create processes or run native code, unseen by audit events
BLOCKED_MODULES = frozenset(
    "_posixsubprocess _posixshmem _multiprocessing _testcapi _testinternalcapi _xxsubinterpreters "
    "_dbm _gdbm readline syslog _cffi_backend".split()
)
# functions that act unseen by audit events: replaced before the hook goes in
DISARMED = (
    (os, "mkfifo"),
    (posix, "mkfifo"),
    (os, "mknod"),
    (posix, "mknod"),
    (os, "pidfd_open"),
    (posix, "pidfd_open"),
    (signal, "pidfd_send_signal"),
)


def refuse(what):
    raise PermissionError(f"not allowed in the python tool: {what}")


def set_limits(memory_mb, cpu_s, file_mb, max_files):
    """Address space, CPU seconds (SIGXCPU at the soft limit, a kill 1 s later), file size, fds."""
    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb * mb, memory_mb * mb))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb * mb, file_mb * mb))
    resource.setrlimit(resource.RLIMIT_NOFILE, (max_files, max_files))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def disarm():
    """Replace the functions audit events do not cover; ctypes is imported here, before the
    guard, because importing it runs dlopen (numpy imports it), and the guard then refuses
    every foreign call, symbol lookup and raw memory access that ctypes would make."""
    import _posixsubprocess  # noqa: F401 - loaded now so that the guard can refuse a reload
    import ctypes  # noqa: F401

    _posixsubprocess.fork_exec = lambda *a, **k: refuse("starting a process")
    for module, name in DISARMED:
        if hasattr(module, name):
            setattr(module, name, lambda *a, _n=name, **k: refuse(_n))


class Guard:
    """The audit hook: refuses what the python tool must not do (see the module docstring)."""

    def __init__(self, workdir):
        self.root = os.path.realpath(workdir)
        prefixes = (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)
        self.install_dirs = tuple({os.path.realpath(p) + os.sep for p in prefixes})

    def inside(self, path):
        real = os.path.realpath(os.fsdecode(path))
        return real == self.root or real.startswith(self.root + os.sep)

    def __call__(self, event, args):
        if event == "socket.__new__" and args[1] == socket.AF_UNIX:
            return  # a local pipe (asyncio's self-pipe); connect, bind and send stay refused
        if event in REFUSED_EVENTS or event.startswith(("socket.", "ctypes.")):
            refuse(event)
        elif event == "open":
            self.check_open(args[0], args[2])
        elif event in PATH_EVENTS:
            for i in PATH_EVENTS[event]:
                # ftruncate needs an fd opened for writing, so one inside; other fds may be any file
                fd_ok = isinstance(args[i], int) and event == "os.truncate"
                if not fd_ok and not self.check_path(args[i]):
                    refuse(f"{event} outside the working directory")
        else:
            self.check_other(event, args)

    def check_path(self, path):
        return not isinstance(path, int) and self.inside(path)

    def check_open(self, path, flags):
        if isinstance(path, int) or self.inside(path):
            return
        if (flags or 0) & WRITE_FLAGS:
            refuse(f"writing {path!r}, outside the working directory")
        if os.path.isdir(path):  # a directory fd would let dir_fd= calls act outside
            refuse(f"opening the directory {path!r}")

    def check_other(self, event, args):
        if event == "os.symlink":
            refuse("symbolic links")
        elif event == "os.chdir" and (isinstance(args[0], int) or os.path.realpath(args[0]) != self.root):
            refuse("changing the working directory")
        elif event == "os.kill" and args[0] != os.getpid():
            refuse("signalling another process")
        elif event == "sqlite3.connect" and args[0] not in (":memory:", "") and not self.check_path(args[0]):
            refuse("a database outside the working directory")
        elif event == "import":
            self.check_import(args)

    def check_import(self, args):
        if args[0].partition(".")[0] in BLOCKED_MODULES:
            refuse(f"importing {args[0]}")
        path = args[1]
        if isinstance(path, str) and args[2] is None:  # a native extension being loaded from `path`
            if not os.path.realpath(path).startswith(self.install_dirs):
                refuse(f"loading native code from {path!r}")


def run(code):
    """Run the code as __main__; an exception prints its traceback (the user's frames, the last
    five) and exits 1."""
    linecache.cache["<code>"] = (len(code), None, code.splitlines(True), "<code>")  # source lines in tracebacks
    try:
        exec(compile(code, "<code>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit:
        raise
    except BaseException as exc:
        report = traceback.TracebackException.from_exception(exc)
        user_frames = [frame for frame in report.stack if frame.filename != __file__]
        report.stack = traceback.StackSummary.from_list(user_frames[-5:])
        sys.stderr.write("".join(report.format()))
        return 1
    return 0


def main(argv):
    workdir = argv[1]
    memory_mb, cpu_s, file_mb, max_files = (int(a) for a in argv[2:6])
    code = sys.stdin.read()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    set_limits(memory_mb, cpu_s, file_mb, max_files)
    disarm()
    sys.addaudithook(Guard(workdir))
    return run(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
