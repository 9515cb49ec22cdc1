"""Install a seccomp filter, then exec the sandboxed command: ``python3 seccomp_launch.py PROGRAM ARGS...``.

Runs inside the sandbox under the host's system Python, so it uses the standard library only (the
sandbox copies this one file into the jail). The filter refuses (EPERM) the system calls an
unprivileged process has no business making in a jail and that widen the kernel's attack surface:
mounts and the new mount API, namespaces (``unshare``, ``setns``, and ``clone`` with any
``CLONE_NEW*`` flag), ``ptrace`` and cross-process memory access, module loading, kexec, ``bpf``,
``perf_event_open``, ``userfaultfd``, io_uring, keyrings, clock and host-name changes. ``clone3``
gets ENOSYS: its flags live in memory a filter cannot read, and ENOSYS makes glibc fall back to
``clone``, whose flags it can. Any call made through another ABI (x32, 32-bit) kills the process.

It is a deny list over the calls that matter rather than an allow list: the jail must run whatever
an agent may call (python3, gcc, coreutils, pip's wheels), and an allow list that covers that is
most of the table, so the list that would be audited is the short one here. x86_64 and aarch64
(Grace Hopper / Blackwell hosts) have tables; on any other machine the command runs without the
filter (the jail's other walls still stand) and ``filter_supported()`` says so.
"""

import ctypes
import os
import platform
import struct
import sys

_COMMON_NAMES = (
    "ptrace", "vhangup", "pivot_root", "chroot", "acct", "settimeofday", "mount", "umount2", "swapon",
    "swapoff", "reboot", "sethostname", "setdomainname", "init_module", "delete_module", "quotactl",
    "lookup_dcookie", "clock_settime", "kexec_load", "add_key", "request_key", "keyctl", "unshare",
    "perf_event_open", "open_by_handle_at", "setns", "process_vm_readv", "process_vm_writev",
    "finit_module", "kexec_file_load", "bpf", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick",
    "mount_setattr", "quotactl_fd",
)
# x86_64: asm/unistd_64.h. aarch64: asm-generic/unistd.h (the numbers from 403 up are shared).
SYSCALLS = {
    "x86_64": {
        "ptrace": 101, "uselib": 134, "vhangup": 153, "pivot_root": 155, "chroot": 161, "acct": 163,
        "settimeofday": 164, "mount": 165, "umount2": 166, "swapon": 167, "swapoff": 168, "reboot": 169,
        "sethostname": 170, "setdomainname": 171, "iopl": 172, "ioperm": 173, "init_module": 175,
        "delete_module": 176, "quotactl": 179, "lookup_dcookie": 212, "clock_settime": 227,
        "kexec_load": 246, "add_key": 248, "request_key": 249, "keyctl": 250, "unshare": 272,
        "perf_event_open": 298, "open_by_handle_at": 304, "setns": 308, "process_vm_readv": 310,
        "process_vm_writev": 311, "finit_module": 313, "kexec_file_load": 320, "bpf": 321,
        "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
        "mount_setattr": 442, "quotactl_fd": 443, "clone": 56, "clone3": 435,
    },
    "aarch64": {
        "lookup_dcookie": 18, "umount2": 39, "mount": 40, "pivot_root": 41, "chroot": 51, "vhangup": 58,
        "quotactl": 60, "acct": 89, "unshare": 97, "kexec_load": 104, "init_module": 105,
        "delete_module": 106, "clock_settime": 112, "ptrace": 117, "reboot": 142, "sethostname": 161,
        "setdomainname": 162, "settimeofday": 170, "add_key": 217, "request_key": 218, "keyctl": 219,
        "clone": 220, "swapon": 224, "swapoff": 225, "perf_event_open": 241, "open_by_handle_at": 265,
        "setns": 268, "process_vm_readv": 270, "process_vm_writev": 271, "finit_module": 273, "bpf": 280,
        "userfaultfd": 282, "kexec_file_load": 294, "io_uring_setup": 425, "io_uring_enter": 426,
        "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
        "fsmount": 432, "fspick": 433, "clone3": 435, "mount_setattr": 442, "quotactl_fd": 443,
    },
}
_X86_ONLY = ("uselib", "iopl", "ioperm")
DENIED = {arch: {n: table[n] for n in _COMMON_NAMES + (_X86_ONLY if arch == "x86_64" else ())}
          for arch, table in SYSCALLS.items()}
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
X32_SYSCALL_BIT = 0x40000000
# CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID |
# CLONE_NEWNET: every namespace flag clone(2) takes (CLONE_NEWTIME's bit is the exit signal there).
CLONE_NS_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 \
    | 0x20000000 | 0x40000000
RET_KILL_PROCESS, RET_ERRNO, RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
EPERM, ENOSYS = 1, 38
LD_W_ABS, JEQ_K, JGE_K, JSET_K, RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
OFF_NR, OFF_ARCH, OFF_ARG0_LO = 0, 4, 16  # struct seccomp_data; args[0]'s low word (little-endian)
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2


def filter_supported(arch: str | None = None) -> bool:
    """Whether this launcher has a syscall table (and so a filter) for ``arch`` (default: this machine)."""
    return (arch or platform.machine()) in SYSCALLS


def program(arch: str = "x86_64") -> bytes:
    """The classic-BPF filter for ``arch`` over ``struct seccomp_data``: 8-byte instructions."""
    table = SYSCALLS[arch]
    ins = [(LD_W_ABS, 0, 0, OFF_ARCH), (JEQ_K, 1, 0, AUDIT_ARCH[arch]), (RET_K, 0, 0, RET_KILL_PROCESS),
           (LD_W_ABS, 0, 0, OFF_NR)]
    if arch == "x86_64":  # the x32 ABI shares the arch value; its numbers carry this bit
        ins += [(JGE_K, 0, 1, X32_SYSCALL_BIT), (RET_K, 0, 0, RET_KILL_PROCESS)]
    ins += [(JEQ_K, 0, 1, table["clone3"]), (RET_K, 0, 0, RET_ERRNO | ENOSYS),
            # clone: refuse namespace flags, allow the rest (fork, threads, vfork)
            (JEQ_K, 0, 4, table["clone"]), (LD_W_ABS, 0, 0, OFF_ARG0_LO), (JSET_K, 0, 1, CLONE_NS_FLAGS),
            (RET_K, 0, 0, RET_ERRNO | EPERM), (RET_K, 0, 0, RET_ALLOW)]
    for nr in sorted(DENIED[arch].values()):
        ins += [(JEQ_K, 0, 1, nr), (RET_K, 0, 0, RET_ERRNO | EPERM)]
    ins.append((RET_K, 0, 0, RET_ALLOW))
    return b"".join(struct.pack("=HBBI", *i) for i in ins)


def install(arch: str) -> None:
    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    code = program(arch)
    buf = ctypes.create_string_buffer(code, len(code))
    fprog = SockFprog(len(code) // 8, ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or \
            libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        sys.exit(f"sandbox: cannot install the seccomp filter ({os.strerror(ctypes.get_errno())})")


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: seccomp_launch.py PROGRAM [ARGS...]")
    if filter_supported():
        install(platform.machine())
    os.execv(sys.argv[1], sys.argv[1:])


if __name__ == "__main__":
    main()
