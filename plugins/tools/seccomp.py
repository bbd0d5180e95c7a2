"""The python tool's seccomp filter: a classic BPF program that bubblewrap loads (`--seccomp FD`).

It is the second kernel layer, under the namespaces: system calls that model-written code never
needs and that have a history of kernel escapes are refused with EPERM, for every process of the
sandbox. Written out by hand (struct-packed `sock_filter`s): the program is about 70
instructions, and pyseccomp (ctypes over libseccomp) would add a package and a C library to
every machine to build it. The layout:

1. a system call of another architecture (i386 `int 0x80` on x86_64) kills the process;
2. x32 system calls (x86_64 numbers with bit 30 set) are refused;
3. `clone` with any CLONE_NEW* flag, `unshare`, `setns` are refused (no new namespaces, so no
   way to gain capabilities inside one); `clone3`, whose flags a filter cannot read, answers
   ENOSYS, so glibc falls back to `clone` for threads and processes;
4. `socket` only for AF_UNIX, AF_INET and AF_INET6 (namespaced; the sandbox's network namespace
   has only a down loopback): AF_VSOCK reaches the hypervisor, AF_NETLINK, AF_PACKET, AF_ALG
   and the rest are refused with EAFNOSUPPORT;
5. the calls in REFUSED (tracing, mounting, BPF, keyrings, perf, io_uring, modules...) -> EPERM;
6. everything else is allowed.
"""

from __future__ import annotations

import errno
import platform
import struct

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
X32_BIT = 0x40000000
CLONE_NEW_FLAGS = 0x7E020080  # NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME
ALLOWED_FAMILIES = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6
# name: (x86_64 number, aarch64 number); None where the architecture has no such call
SYSCALLS = {
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "kcmp": (312, 272),
    "pidfd_getfd": (438, 438),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "chroot": (161, 51),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "fspick": (433, 433),
    "mount_setattr": (442, 442),
    "unshare": (272, 97),
    "setns": (308, 268),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "open_by_handle_at": (304, 265),
    "name_to_handle_at": (303, 264),
    "fanotify_init": (300, 262),
    "kexec_load": (246, 104),
    "kexec_file_load": (320, 294),
    "init_module": (175, 105),
    "finit_module": (313, 273),
    "delete_module": (176, 106),
    "reboot": (169, 142),
    "swapon": (167, 224),
    "swapoff": (168, 225),
    "acct": (163, 89),
    "quotactl": (179, 60),
    "quotactl_fd": (443, 443),
    "syslog": (103, 116),
    "lookup_dcookie": (212, 18),
    "vhangup": (153, 58),
    "settimeofday": (164, 170),
    "clock_settime": (227, 112),
    "clock_adjtime": (305, 266),
    "adjtimex": (159, 171),
    "iopl": (172, None),
    "ioperm": (173, None),
    "uselib": (134, None),
    # inspected or answered specially, not in REFUSED
    "clone": (56, 220),
    "clone3": (435, 435),
    "socket": (41, 198),
}
SPECIAL = ("clone", "clone3", "socket")
REFUSED = tuple(name for name in SYSCALLS if name not in SPECIAL)

# classic BPF opcodes and seccomp return values (linux/filter.h, linux/seccomp.h)
LD_W_ABS, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
RET_ALLOW, RET_KILL_PROCESS, RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
# offsets in struct seccomp_data: nr, arch, then the arguments (the low 32 bits of args[0])
OFF_NR, OFF_ARCH, OFF_ARG0 = 0, 4, 16


def program(machine: str | None = None) -> bytes:
    """The compiled filter for `machine` (platform.machine() when None), as bwrap reads it."""
    machine = machine or platform.machine()
    if machine not in AUDIT_ARCH:
        raise ValueError(f"no seccomp filter for the {machine} architecture (x86_64 and aarch64 only)")
    column = 0 if machine == "x86_64" else 1
    number = {name: nums[column] for name, nums in SYSCALLS.items() if nums[column] is not None}
    code: list[tuple] = [
        (LD_W_ABS, None, None, OFF_ARCH),
        (JEQ, None, "kill", AUDIT_ARCH[machine]),
        (LD_W_ABS, None, None, OFF_NR),
    ]
    if machine == "x86_64":
        code.append((JGE, "eperm", None, X32_BIT))
    code += [(JEQ, "eperm", None, number[name]) for name in REFUSED if name in number]
    code += [
        (JEQ, "enosys", None, number["clone3"]),
        (JEQ, "clone", None, number["clone"]),
        (JEQ, "socket", None, number["socket"]),
        (RET, None, None, RET_ALLOW),
        ("clone", LD_W_ABS, None, None, OFF_ARG0),
        (JSET, "eperm", None, CLONE_NEW_FLAGS),
        (RET, None, None, RET_ALLOW),
        ("socket", LD_W_ABS, None, None, OFF_ARG0),
        *[(JEQ, "allow", None, family) for family in ALLOWED_FAMILIES],
        (RET, None, None, RET_ERRNO | errno.EAFNOSUPPORT),
        ("allow", RET, None, None, RET_ALLOW),
        ("eperm", RET, None, None, RET_ERRNO | errno.EPERM),
        ("enosys", RET, None, None, RET_ERRNO | errno.ENOSYS),
        ("kill", RET, None, None, RET_KILL_PROCESS),
    ]
    return _assemble(code)


def _assemble(code: list[tuple]) -> bytes:
    """Instructions (op, jump-if-true label, jump-if-false label, k), each optionally led by its
    own label, as packed sock_filter structs; a None label falls through to the next one."""
    labels = {ins[0]: i for i, ins in enumerate(code) if isinstance(ins[0], str)}
    out = bytearray()
    for i, ins in enumerate(code):
        op, true, false, k = ins[1:] if isinstance(ins[0], str) else ins
        offsets = [labels[target] - i - 1 if target else 0 for target in (true, false)]
        assert all(0 <= off < 256 for off in offsets), "a jump out of classic BPF's 8-bit range"
        out += struct.pack("=HBBI", op, *offsets, k)
    return bytes(out)
