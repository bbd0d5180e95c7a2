"""The python tool's program inside its sandbox: limits itself, arms a tripwire, runs the code.

Standard library only: it must not import minirl (torch would blow the memory limit and cost
seconds per call). Two roles:

- `sandbox_child.py init STATUS_FD WORKER_ARGS...`: the first process of a bubblewrap sandbox
  (PID 1 of its PID namespace; python_exec.py and bwrap.py start it). Started as uid 0 of the
  sandbox's user namespace (the trainer ran as root), it first becomes uid 65534 for good. It
  forks the worker, reaps every process until the worker ends, writes the worker's exit status
  to STATUS_FD (a pipe the worker cannot write to) and exits: the kernel then kills every other
  process of the namespace, so nothing the code started outlives the call.
- `sandbox_child.py WORKDIR MEMORY_MB CPU_S FILE_MB MAX_FILES MAX_PROCESSES` (the worker; the
  whole program in `sandbox = "process"` mode): reads the code from stdin, closes stdin, sets its
  resource limits, arms the tripwire and runs the code in WORKDIR.

The tripwire (a sys.addaudithook hook) refuses network sockets, writes and file changes outside
WORKDIR, starting processes, signalling other processes, raising limits, foreign-function calls
(ctypes) and loading native code from outside the Python install. It stops mistakes early with a
clear message. It is not a boundary: code in the same interpreter can rebind it, reach C modules
it never sees or corrupt the interpreter. In bubblewrap mode the kernel is the boundary
(docs/agents.md); in process mode nothing is.
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


def set_limits(memory_mb, cpu_s, file_mb, max_files, max_processes):
    """Address space, CPU seconds (SIGXCPU at the soft limit, a kill 1 s later), file size, fds,
    and (max_processes > 0, in a sandbox of its own) the processes and threads of the sandbox's
    uid: the kernel counts them per user namespace, so this caps this call alone."""
    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb * mb, memory_mb * mb))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb * mb, file_mb * mb))
    resource.setrlimit(resource.RLIMIT_NOFILE, (max_files, max_files))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if max_processes > 0:
        resource.setrlimit(resource.RLIMIT_NPROC, (max_processes, max_processes))


def disarm():
    """Replace the functions audit events do not cover; ctypes is imported here, before the
    tripwire, because importing it runs dlopen (numpy imports it), and the tripwire then refuses
    every foreign call, symbol lookup and raw memory access that ctypes would make."""
    import _posixsubprocess  # noqa: F401 - loaded now so that the tripwire can refuse a reload
    import ctypes  # noqa: F401

    _posixsubprocess.fork_exec = lambda *a, **k: refuse("starting a process")
    for module, name in DISARMED:
        if hasattr(module, name):
            setattr(module, name, lambda *a, _n=name, **k: refuse(_n))


class Tripwire:
    """The audit hook: refuses what the python tool's code should not do (the module docstring
    says what, and why it is not a boundary)."""

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


def worker(argv):
    workdir = argv[0]
    memory_mb, cpu_s, file_mb, max_files, max_processes = (int(a) for a in argv[1:6])
    code = sys.stdin.read()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.chdir(workdir)
    set_limits(memory_mb, cpu_s, file_mb, max_files, max_processes)
    disarm()
    sys.addaudithook(Tripwire(workdir))
    return run(code)


def init(status_fd, worker_argv):
    """PID 1 of the sandbox: become uid 65534, fork the worker, reap until it ends, report its
    status (its exit code, or minus the signal that killed it) on status_fd."""
    if os.getuid() == 0:  # the trainer runs as root: its uid maps to 0 here, 65534 to the host's 65534
        os.setgroups([])
        os.setresgid(65534, 65534, 65534)
        os.setresuid(65534, 65534, 65534)  # drops the capabilities bwrap left for this
    os.closerange(3, status_fd)  # what bwrap was handed (the seccomp program, its pipes) stays out
    os.closerange(status_fd + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    pid = os.fork()
    if pid == 0:
        os.close(status_fd)
        sys.exit(worker(worker_argv))  # the interpreter's own exit: output flushed, threads joined
    sys.stdin.close()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # only the worker's end (or the host) ends PID 1
    while True:
        done, status = os.wait()
        if done == pid:
            os.write(status_fd, str(os.waitstatus_to_exitcode(status)).encode())
            return 0


def main(argv):
    if argv[1] == "init":
        return init(int(argv[2]), argv[3:])
    return worker(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
