"""The seccomp filter's verdicts on x86_64 and aarch64, read by running its BPF program here.

The filter only runs on the machine it was built for; these tests decode the program and evaluate
it with a small interpreter for the classic-BPF subset it emits, so the aarch64 filter (Grace
Hopper / Blackwell hosts) is checked on an x86_64 CI machine, and the tables are checked against
the kernel headers where they are installed.
"""

import re
import struct
from pathlib import Path

import pytest

from envs import seccomp_launch as sl

CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWNS, SIGCHLD = 0x10000000, 0x40000000, 0x00020000, 17
THREAD_FLAGS = 0x3D0F00  # what pthread_create passes: VM|FS|FILES|SIGHAND|THREAD|SYSVSEM|SETTLS|*TID
ALLOW, KILL = sl.RET_ALLOW, sl.RET_KILL_PROCESS
EPERM, ENOSYS = sl.RET_ERRNO | sl.EPERM, sl.RET_ERRNO | sl.ENOSYS


def run_bpf(code: bytes, nr: int, arch: int, args: tuple[int, ...] = ()) -> int:
    """Evaluate a classic-BPF seccomp program on one ``struct seccomp_data``."""
    args = (list(args) + [0] * 6)[:6]
    data = struct.pack("<iIQ6Q", nr, arch, 0, *args)
    ins = [struct.unpack("=HBBI", code[i:i + 8]) for i in range(0, len(code), 8)]
    acc, pc = 0, 0
    for _ in range(len(ins) + 1):  # no backward jumps in classic BPF: each instruction runs once at most
        op, jt, jf, k = ins[pc]
        if op == sl.LD_W_ABS:
            acc = struct.unpack_from("<I", data, k)[0]
        elif op == sl.RET_K:
            return k
        elif op in (sl.JEQ_K, sl.JGE_K, sl.JSET_K):
            taken = {sl.JEQ_K: acc == k, sl.JGE_K: acc >= k, sl.JSET_K: bool(acc & k)}[op]
            pc += jt if taken else jf
        else:
            raise AssertionError(f"instruction {op:#x} at {pc} is outside the interpreter's subset")
        pc += 1
    raise AssertionError("the program ran off its end")


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_verdicts_per_arch(arch):
    code, audit, nr = sl.program(arch), sl.AUDIT_ARCH[arch], sl.SYSCALLS[arch]
    assert len(code) % 8 == 0 and len(code) // 8 < 4096  # the kernel's BPF_MAXINSNS
    for name in ("mount", "umount2", "unshare", "setns", "ptrace", "bpf", "keyctl", "io_uring_setup",
                 "process_vm_readv", "perf_event_open", "init_module", "open_tree", "fsopen"):
        assert run_bpf(code, nr[name], audit) == EPERM, name
    assert run_bpf(code, nr["clone3"], audit) == ENOSYS  # glibc then falls back to clone
    for flags in (CLONE_NEWUSER | SIGCHLD, CLONE_NEWNET, CLONE_NEWNS | SIGCHLD, CLONE_NEWUSER | THREAD_FLAGS):
        assert run_bpf(code, nr["clone"], audit, (flags,)) == EPERM, hex(flags)
    assert run_bpf(code, nr["clone"], audit, (SIGCHLD,)) == ALLOW  # fork
    assert run_bpf(code, nr["clone"], audit, (THREAD_FLAGS,)) == ALLOW  # a thread
    assert run_bpf(code, nr["clone"], audit, (0x4111,)) == ALLOW  # vfork: VM|VFORK|SIGCHLD
    other = "x86_64" if arch == "aarch64" else "aarch64"
    assert run_bpf(code, nr["clone"], sl.AUDIT_ARCH[other]) == KILL
    assert run_bpf(code, 0x40000003, 0x40000003) == KILL  # 32-bit ARM / i386 ABI


def test_arch_specific_numbers_are_not_confused():
    """A number refused on one arch is an ordinary call on the other: the tables are not shared."""
    x86, arm = sl.program("x86_64"), sl.program("aarch64")
    x86_arch, arm_arch = sl.AUDIT_ARCH["x86_64"], sl.AUDIT_ARCH["aarch64"]
    # aarch64's clone (220) is x86_64's semtimedop; x86_64's clone (56) is aarch64's openat.
    assert run_bpf(x86, 220, x86_arch, (CLONE_NEWUSER,)) == ALLOW
    assert run_bpf(arm, 56, arm_arch, (CLONE_NEWUSER,)) == ALLOW
    # 165 is mount on x86_64 and getrusage on aarch64; 40 is mount on aarch64 and sendfile on x86_64.
    assert run_bpf(x86, 165, x86_arch) == EPERM and run_bpf(arm, 165, arm_arch) == ALLOW
    assert run_bpf(arm, 40, arm_arch) == EPERM and run_bpf(x86, 40, x86_arch) == ALLOW
    for nr in (0, 1, 2, 3, 9, 57, 59, 60, 231):  # read write open close mmap fork execve exit exit_group
        assert run_bpf(x86, nr, x86_arch) == ALLOW
    assert run_bpf(x86, 39 | sl.X32_SYSCALL_BIT, x86_arch) == KILL  # x32 getpid
    for nr in (63, 64, 56, 57, 221, 222, 93, 94, 172):  # read write openat close execve mmap exit ...
        assert run_bpf(arm, nr, arm_arch) == ALLOW


def _header_numbers(path: Path, generic: bool) -> dict[str, int]:
    text = path.read_text()
    found = {}
    for name, value in re.findall(r"#define __NR(?:3264)?_(\w+)\s+(\d+)", text):
        found.setdefault(name, int(value))
    if generic:  # asm-generic names a few calls by their 64-bit alias
        found.setdefault("fadvise64", found.get("fadvise64_64", -1))
    return found


@pytest.mark.parametrize("arch, header", [
    ("x86_64", "/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
    ("aarch64", "/usr/include/asm-generic/unistd.h"),
])
def test_tables_match_the_kernel_headers(arch, header):
    path = Path(header)
    if not path.exists():
        pytest.skip(f"{header} is not installed (linux-libc-dev)")
    numbers = _header_numbers(path, generic=arch == "aarch64")
    for name, nr in sl.SYSCALLS[arch].items():
        assert numbers.get(name) == nr, (arch, name, nr, numbers.get(name))
