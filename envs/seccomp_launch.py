"""Install a seccomp filter, then exec the sandboxed command: ``python3 seccomp_launch.py PROGRAM ARGS...``.

Runs inside the sandbox under the host's system Python, so it uses the standard library only.
The filter refuses (EPERM) the system calls an unprivileged process has no business making in a
jail and that widen the kernel's attack surface: mounts and the new mount API, namespaces
(``unshare``, ``setns``), ``ptrace`` and cross-process memory access, module loading, kexec,
``bpf``, ``perf_event_open``, ``userfaultfd``, io_uring, keyrings, clock and host-name changes. Any
call made through another ABI (x32, 32-bit) kills the process. The numbers are x86_64's; on other
architectures the command runs without the filter (the sandbox's other walls still stand).
"""

import ctypes
import os
import platform
import struct
import sys

# x86_64 numbers (asm/unistd_64.h).
DENIED = {
    "ptrace": 101, "uselib": 134, "vhangup": 153, "pivot_root": 155, "chroot": 161, "acct": 163,
    "settimeofday": 164, "mount": 165, "umount2": 166, "swapon": 167, "swapoff": 168, "reboot": 169,
    "sethostname": 170, "setdomainname": 171, "iopl": 172, "ioperm": 173, "init_module": 175,
    "delete_module": 176, "quotactl": 179, "lookup_dcookie": 212, "clock_settime": 227, "kexec_load": 246,
    "add_key": 248, "request_key": 249, "keyctl": 250, "unshare": 272, "perf_event_open": 298,
    "open_by_handle_at": 304, "setns": 308, "process_vm_readv": 310, "process_vm_writev": 311,
    "finit_module": 313, "kexec_file_load": 320, "bpf": 321, "userfaultfd": 323, "io_uring_setup": 425,
    "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsopen": 430,
    "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
}
AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
RET_KILL_PROCESS, RET_ERRNO, RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
EPERM = 1
LD_W_ABS, JEQ_K, JGE_K, RET_K = 0x20, 0x15, 0x35, 0x06
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2


def program() -> bytes:
    """The classic-BPF filter over ``struct seccomp_data`` (nr at offset 0, arch at 4)."""
    ins = [(LD_W_ABS, 0, 0, 4), (JEQ_K, 1, 0, AUDIT_ARCH_X86_64), (RET_K, 0, 0, RET_KILL_PROCESS),
           (LD_W_ABS, 0, 0, 0), (JGE_K, 0, 1, X32_SYSCALL_BIT), (RET_K, 0, 0, RET_KILL_PROCESS)]
    for nr in sorted(DENIED.values()):
        ins += [(JEQ_K, 0, 1, nr), (RET_K, 0, 0, RET_ERRNO | EPERM)]
    ins.append((RET_K, 0, 0, RET_ALLOW))
    return b"".join(struct.pack("=HBBI", *i) for i in ins)


def install() -> None:
    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    code = program()
    buf = ctypes.create_string_buffer(code, len(code))
    fprog = SockFprog(len(code) // 8, ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or \
            libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        sys.exit(f"sandbox: cannot install the seccomp filter ({os.strerror(ctypes.get_errno())})")


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: seccomp_launch.py PROGRAM [ARGS...]")
    if platform.machine() == "x86_64":
        install()
    os.execv(sys.argv[1], sys.argv[1:])


if __name__ == "__main__":
    main()
