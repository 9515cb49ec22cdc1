"""Run an agent's shell command in a throwaway jail, one per episode.

Each sandbox holds, for its life, a uid of its own (``envs.jail.uids``: 0x60000000 + n, a lock file per
uid), a memory and pids cgroup of its own (``envs.jail.cgroups``: v2 where mounted, v1 otherwise) and
a size-limited writable area (a tmpfs of ``disk_bytes`` at ``workdir``). Each ``run(cmd)`` starts
fresh network, mount, pid, IPC and UTS namespaces (``unshare``) whose pid 1 is ``envs.jail.init``; the
command runs chrooted into a tmpfs holding only read-only binds of the system directories (``/usr``,
``/bin``, ``/lib`` ...), ``/dev/null``, a private ``/proc`` and the episode's area at ``/work``. So:

- no network: the namespace has only a loopback device, and it is down;
- no access outside the episode directory: the rest of the host filesystem is not mounted, system
  directories are read-only, and the sandbox's uid cannot remount them;
- no privilege to gain: every mount is ``nosuid`` (and ``nodev`` but ``/dev/null``), the command
  starts with ``no_new_privs`` and an empty capability bounding set (``setpriv``), so the host's
  setuid-root binaries (``mount``, ``su`` ...) run with the sandbox's uid;
- a smaller kernel surface: a seccomp filter (``envs/seccomp_launch.py``; x86_64 and aarch64)
  refuses mounts, namespaces (``clone`` with ``CLONE_NEW*`` too), ``ptrace``, module loading, ``bpf``,
  io_uring and the like;
- bounded resources, per sandbox: memory (the cgroup counts every process, memfd files, shared
  memory and the files in ``/work``), processes and threads (``pids.max``), disk (the tmpfs size),
  wall clock, CPU seconds / address space / file size per process (rlimits), output
  (``max_output_bytes``);
- nothing outlives a run or the sandbox: when the command exits, when the wall clock runs out, or
  when the sandbox's owner dies, init exits and the kernel kills the whole pid namespace; the
  cgroup is killed after every run and at ``close()``; the IPC namespace takes SysV shared memory
  and message queues with it; ``close()`` unmounts and removes the directory and frees the uid.

Namespaces need root. Where they are unavailable ``Sandbox`` refuses to run unless
``allow_unisolated=True`` (rlimits, the timeout and the output cap only); where no cgroup can bound
memory and processes it refuses unless ``allow_unbounded_memory=True``. ``check_jail_support`` says
the same in one line before an environment starts.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import shutil
import signal
import subprocess
import tempfile
import time
import weakref
from pathlib import Path

from envs.jail.cgroups import CgroupError, SandboxCgroup, detect, remove_stale
from envs.jail.uids import UidLease, UidsExhausted, kill_uid

_LAUNCHER = Path(__file__).with_name("seccomp_launch.py")
_INIT = Path(__file__).with_name("jail") / "init.py"
_SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "etc/alternatives")
ALLOW_UNBOUNDED_ENV = "MIXRL_SANDBOX_ALLOW_UNBOUNDED_MEMORY"
INIT_PIDS = 2  # unshare and the jail's init sit in the cgroup beside the command's processes
MAX_COMMAND_BYTES = 100_000  # under the kernel's 128 KiB cap on one argument / environment string
# The launcher's first process joins the cgroups, then becomes prlimit -> unshare -> init.
_JOIN = 'for f in $MIXRL_CG_PROCS; do echo $$ > "$f" || exit 125; done; exec "$@"'
MS_NOSUID, MS_NODEV, MNT_DETACH = 2, 4, 2


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot give its promises here (and the caller did not opt out of them)."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    wall_seconds: float = 5.0
    cpu_seconds: int = 5
    memory_bytes: int = 512 * 1024**2
    file_bytes: int = 8 * 1024**2
    max_processes: int = 64
    max_output_bytes: int = 4096
    disk_bytes: int = 64 * 1024**2

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"sandbox limits: {field.name} must be a number > 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    output: str
    exit_code: int | None
    timed_out: bool
    output_truncated: bool
    isolated: bool

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.output_truncated


@functools.cache
def sandbox_available() -> bool:
    """Whether namespaces can be created here (root; ``unshare``, ``chroot``, ``setpriv`` and the
    system's ``/usr/bin/python3`` present)."""
    if os.geteuid() != 0 or not all(shutil.which(c) for c in ("unshare", "chroot", "prlimit", "setpriv")) \
            or not os.path.exists("/usr/bin/python3"):  # the init's and seccomp launcher's interpreter
        return False
    probe = subprocess.run(["unshare", "--net", "--mount", "--pid", "--ipc", "--uts", "--fork", "true"],
                           capture_output=True, timeout=10)
    return probe.returncode == 0


@functools.cache
def cgroup_version() -> str | None:
    """``"v2"`` or ``"v1"`` when this process can create memory+pids cgroups for sandboxes, else None.
    Found by creating (and removing) one with limits, once per process: a v2 tree that will not
    hand its controllers down, or a read-only cgroupfs, is no cgroup."""
    found = detect() if os.geteuid() == 0 else None
    if found is None:
        return None
    try:
        SandboxCgroup(f"probe-{os.getpid()}", memory_bytes=64 << 20, max_pids=8, found=found).remove()
    except (CgroupError, OSError):
        return None
    return found[0]


def jail_problem() -> str | None:
    """Why a sandbox here could not bound its memory and processes, or None when it can."""
    if os.geteuid() != 0:
        return (f"running as uid {os.geteuid()}, not root: no namespaces, per-sandbox uids or cgroups, "
                "so memory is bounded per process only")
    if not sandbox_available():
        return "namespaces are unavailable (unshare --net --mount --pid --ipc --uts failed)"
    if cgroup_version() is None:
        return ("no usable cgroup with the memory and pids controllers (v2 at /sys/fs/cgroup, or v1 "
                "at /sys/fs/cgroup/memory and /sys/fs/cgroup/pids), so memory is bounded per process only")
    return None


def check_jail_support(allow_unbounded_memory: bool = False, *, allow_unisolated: bool = False) -> None:
    """Refuse to start an environment whose sandboxes could not bound memory and processes: one
    line (``SandboxUnavailable``) naming the problem and the opt-out. ``allow_unisolated`` (no
    namespaces at all, chosen explicitly) and ``MIXRL_SANDBOX_ALLOW_UNBOUNDED_MEMORY=1`` opt out too."""
    if allow_unbounded_memory or allow_unisolated or os.environ.get(ALLOW_UNBOUNDED_ENV) == "1":
        return
    problem = jail_problem()
    if problem:
        raise SandboxUnavailable(f"sandbox: {problem}; set allow_unbounded_memory: true to run anyway")


@dataclasses.dataclass
class _Held:
    """What a sandbox holds on the host; released once, by ``close()`` or when it is collected."""
    base: Path
    workdir: Path
    lease: UidLease | None = None
    cgroup: SandboxCgroup | None = None
    mounted: bool = False
    owner: int = dataclasses.field(default_factory=os.getpid)

    def release(self) -> None:
        if os.getpid() != self.owner:
            return  # a forked child exiting (its copy of the finalizer): the sandbox is its parent's
        if self.cgroup is not None:
            self.cgroup.kill()
        if self.lease is not None:
            kill_uid(self.lease.uid)
        if self.mounted:
            _libc().umount2(str(self.workdir).encode(), MNT_DETACH)
        shutil.rmtree(self.base, ignore_errors=True)
        if self.cgroup is not None:
            self.cgroup.remove()
        if self.lease is not None:
            self.lease.release()


def _clean_after(previous: str) -> None:
    """Unmount and remove the directory of a sandbox whose owner died holding the same uid."""
    base = Path(previous) if previous else None
    if base is None or not base.name.startswith("mixrl-sandbox-") \
            or base.parent != Path(tempfile.gettempdir()):
        return
    _libc().umount2(str(base / "work").encode(), MNT_DETACH)
    shutil.rmtree(base, ignore_errors=True)


def _reclaim(uid: int, previous: str) -> None:
    """Everything a dead owner of ``uid`` left: its directory and mount, and its cgroups."""
    _clean_after(previous)
    if cgroup_version() is not None:
        remove_stale(f"sb-{uid}")


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


class Sandbox:
    """One episode's sandbox: a fresh directory, a uid, a cgroup and a way to run commands.

    Use as a context manager; ``close()`` leaves no process, IPC object, mount or directory behind.
    """

    def __init__(self, limits: SandboxLimits | None = None, *, allow_unisolated: bool = False,
                 allow_unbounded_memory: bool = False):
        self.limits = limits or SandboxLimits()
        self.isolated = sandbox_available()
        if not self.isolated and not allow_unisolated:
            raise SandboxUnavailable("namespace sandbox unavailable (needs root and util-linux unshare); "
                                     "pass allow_unisolated=True to run with rlimits only")
        if self.isolated and cgroup_version() is None and not allow_unbounded_memory \
                and os.environ.get(ALLOW_UNBOUNDED_ENV) != "1":
            raise SandboxUnavailable(f"sandbox: {jail_problem()}; "
                                     "set allow_unbounded_memory: true to run anyway")
        base = Path(tempfile.mkdtemp(prefix="mixrl-sandbox-"))
        self._held = _Held(base=base, workdir=base / "work")
        self._close = weakref.finalize(self, self._held.release)
        self.workdir = self._held.workdir
        self.workdir.mkdir()
        (base / "jail").mkdir()
        self.uid = os.getuid()
        self.cgroup: SandboxCgroup | None = None
        if self.isolated:
            try:
                self._acquire()
            except (CgroupError, UidsExhausted, OSError, ValueError) as e:
                self.close()
                raise SandboxUnavailable(f"sandbox: {e}") from None
            except BaseException:
                self.close()
                raise

    def _acquire(self) -> None:
        lim = self.limits
        self._held.lease = lease = UidLease()
        self.uid = lease.uid
        _clean_after(lease.previous)
        lease.record(str(self._held.base))
        lease.reclaim_orphans(_reclaim)
        if cgroup_version() is not None:
            self.cgroup = self._held.cgroup = SandboxCgroup(
                f"sb-{lease.uid}", memory_bytes=lim.memory_bytes, max_pids=lim.max_processes + INIT_PIDS)
        options = f"size={lim.disk_bytes},mode=0700,uid={lease.uid},gid={lease.uid}".encode()
        if _libc().mount(b"tmpfs", str(self.workdir).encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot mount the work tmpfs: {os.strerror(err)}")
        self._held.mounted = True

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kill everything the sandbox started, unmount and remove its directory, free its uid."""
        self._close()

    def write_file(self, name: str, content: str) -> None:
        """Place a task file in the episode directory (owned by the sandbox user)."""
        path = (self.workdir / name).resolve()
        if self.workdir.resolve() not in path.parents:
            raise ValueError(f"{name!r} is outside the sandbox directory")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        if self.isolated:
            for p in [path, *path.parents]:
                if p == self.workdir.resolve():
                    break
                os.chown(p, self.uid, self.uid)

    def _limits_prefix(self) -> list[str]:
        # rlimits through prlimit(1) rather than a preexec_fn: forking a multithreaded process
        # (JAX, torch) and running Python in the child before exec is unsafe. Root (the jail's
        # init) is exempt from the process limit; it binds once the command runs as the sandbox uid.
        lim = self.limits
        return ["prlimit", f"--cpu={lim.cpu_seconds}", f"--as={lim.memory_bytes}",
                f"--fsize={lim.file_bytes}", "--core=0", f"--nproc={lim.max_processes + INIT_PIDS}", "--"]

    def run(self, command: str) -> SandboxResult:
        if "\0" in command:
            raise ValueError("command contains a NUL byte")
        if len(command.encode()) > MAX_COMMAND_BYTES:
            raise ValueError(f"command is {len(command.encode())} bytes; the sandbox takes at most "
                             f"{MAX_COMMAND_BYTES}")
        if not self._close.alive:
            raise RuntimeError("the sandbox is closed")
        if not self.isolated:
            proc = subprocess.Popen(self._limits_prefix() + ["/bin/sh", "-c", command], cwd=self.workdir,
                                    env={"PATH": "/usr/bin:/bin"}, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            return self._collect(proc)
        # The init's end-of-file on this pipe means the owner is gone: the namespace dies with it.
        owner_r, owner_w = os.pipe()
        argv = ["/bin/sh", "-c", _JOIN, "sh", *self._limits_prefix(), "unshare", "--net", "--mount", "--pid",
                "--ipc", "--uts", "--fork", "--kill-child", "/usr/bin/python3", "-I", "-S", str(_INIT),
                str(owner_r)]
        env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "JAIL": str(self._held.base / "jail"),
               "WORK": str(self.workdir), "CMD": command, "SYSTEM_DIRS": " ".join(_SYSTEM_DIRS),
               "LAUNCHER": str(_LAUNCHER), "SANDBOX_UID": str(self.uid),
               "MIXRL_CG_PROCS": " ".join(map(str, self.cgroup.procs_files)) if self.cgroup else ""}
        try:
            proc = subprocess.Popen(argv, cwd="/", env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True, pass_fds=(owner_r,))
        finally:
            os.close(owner_r)
        try:
            return self._collect(proc)
        finally:
            os.close(owner_w)
            if self.cgroup is not None:
                self.cgroup.kill()  # normally empty already: init's exit took the namespace down

    def _kill(self, proc: subprocess.Popen) -> None:
        if self.cgroup is not None:
            self.cgroup.kill()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _collect(self, proc: subprocess.Popen) -> SandboxResult:
        cap = self.limits.max_output_bytes
        deadline = time.monotonic() + self.limits.wall_seconds
        chunks, size, timed_out, truncated = [], 0, False, False
        os.set_blocking(proc.stdout.fileno(), False)
        while True:
            try:
                data = proc.stdout.read(65536)
            except BlockingIOError:
                data = None
            if data:
                chunks.append(data)
                size += len(data)
                if size > cap:
                    truncated = True
                    break
            elif data == b"":  # EOF: every writer has exited
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            if not data:
                time.sleep(0.005)
        if timed_out or truncated:
            self._kill(proc)
        try:
            code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            self._kill(proc)
            code = proc.wait()
        proc.stdout.close()
        output = b"".join(chunks)[:cap].decode("utf-8", errors="replace")
        return SandboxResult(output=output, exit_code=None if (timed_out or truncated) else code,
                             timed_out=timed_out, output_truncated=truncated, isolated=self.isolated)
