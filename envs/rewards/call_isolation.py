"""What a reward call runs in: a uid, a cgroup, a private ``/dev/shm`` and IPC namespace.

The pool (``envs.rewards.RewardPool``, the trainer's side) decides once what this host can give
(``plan``) and, for each worker it starts, holds a ``WorkerJail``: a uid leased from the jail's
range (``envs.jail.uids``, the lease the sandboxes take) and a memory + pids cgroup
(``envs.jail.cgroups``, ``<parent>/sb-<uid>``) for the worker's life. The worker
(``envs.rewards.worker``, root) gets them as ``CallJail`` and, in each call's forked child, before
the reward function runs: joins the cgroup, unshares a mount and an IPC namespace, mounts a fresh
size-bounded tmpfs on ``/dev/shm``, makes the interpreter's and the import path's directories
reachable for the uid (below), drops to the uid with no groups, and sets ``no_new_privs``.

Why one uid and one cgroup per worker, not per call: a worker runs one call at a time and kills
its cgroup (everything the call started, whatever session it moved to) before it answers, so two
calls never run as the uid at once; leasing a uid (a lock-file scan and a ``/proc`` scan) and
creating a cgroup per call would add milliseconds to every call for nothing more. What calls of
one worker can still share is files the uid left outside ``/dev/shm`` (``/tmp``): documented.

The interpreter and the import path. A call runs as a uid that owns nothing; where Python lives
under a directory only root may enter (pyenv or conda under ``/root``, mode 0700), the call could
neither import a module lazily nor start ``sys.executable``. In the call's own mount namespace,
each such directory on the way to a needed path (``sys.prefix``, ``sys.base_prefix``, the
executable's directory, every ``sys.path`` entry, the working directory) is covered by a tmpfs
that holds only binds of the needed entries below it: ``/root/.pyenv`` is reachable, the rest of
``/root`` is not there at all. A needed directory that is itself closed to others (a working
directory of mode 0700) is not opened up: the pool names it in a warning at start.

Where the trainer is not root, no uid, cgroup or namespace is possible (and
``MIXRL_REWARD_ISOLATION=fork`` asks for that mode on purpose): calls keep the fork, the rlimits,
the death signal, the subreaper and the nonce, and ``plan`` returns one line saying what is not
enforced.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import stat
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from envs.jail.cgroups import SandboxCgroup
from envs.jail.uids import UidLease, kill_uid

ISOLATION_ENV = "MIXRL_REWARD_ISOLATION"  # "fork": today's isolation only, even as root
ISOLATION_MODES = ("full", "fork")
#: Processes and threads one call may have at once (the cgroup's ``pids.max``): a fork bomb stops
#: there, and a numerical library's thread pool on a large host still fits.
CALL_MAX_PIDS = 512
#: The private ``/dev/shm`` of a call with no memory limit (with one, the limit is its size too).
DEFAULT_SHM_BYTES = 256 * 1024**2
_NO_LIMIT = 1 << 62  # the kernel clamps a cgroup limit this large to "no limit"
CLONE_NEWNS, CLONE_NEWIPC = 0x00020000, 0x08000000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 4096, 16384, 1 << 18
PR_SET_NO_NEW_PRIVS = 38


class IsolationError(RuntimeError):
    """A call's isolation could not be set up: the call must not run without it."""


@dataclass(frozen=True)
class Plan:
    """What this host gives every reward call; ``gaps`` names what it does not (empty when all)."""
    uid: bool
    cgroup: bool
    namespaces: bool
    gaps: tuple[str, ...] = ()

    def warning(self) -> str | None:
        """The one line the pool logs at start, or None when everything is enforced."""
        return f"reward calls: {'; '.join(self.gaps)}" if self.gaps else None


def describe_gaps(*, uid: str | None, cgroup: str | None, namespaces: str | None) -> tuple[str, ...]:
    """What each missing part leaves open, given why it is missing (None: it is there)."""
    gaps = []
    if uid:
        gaps.append(f"no per-call uid ({uid}): a call runs as the trainer's user, can signal the "
                    "trainer and the pool's workers and read what the trainer can")
    if cgroup:
        gaps.append(f"no cgroup memory limit ({cgroup}): shmem and memfd are not counted, only the "
                    "address space (RLIMIT_AS), and a setsid process that clears its death signal "
                    "outlives close() if its worker dies first")
    if namespaces:
        gaps.append(f"no private /dev/shm or IPC namespace ({namespaces}): files and SysV segments "
                    "a call leaves there outlive it, and calls see each other's")
    return tuple(gaps)


def plan(mode: str | None = None) -> Plan:
    """What this host can give calls: everything as root with a usable cgroup (``mode`` "full", the
    default), nothing beyond the fork where not root or where ``mode`` (or ``MIXRL_REWARD_ISOLATION``)
    is "fork"."""
    mode = mode or os.environ.get(ISOLATION_ENV) or "full"
    if mode not in ISOLATION_MODES:
        raise ValueError(f"{ISOLATION_ENV}={mode!r}: give one of {', '.join(ISOLATION_MODES)}")
    if mode == "fork":
        why = f"{ISOLATION_ENV}=fork"
        return Plan(False, False, False, describe_gaps(uid=why, cgroup=why, namespaces=why))
    if os.geteuid() != 0:
        why = f"not root: uid {os.geteuid()}"
        return Plan(False, False, False, describe_gaps(uid=why, cgroup=why, namespaces=why))
    namespaces, uid = _probe()
    why_ns = None if namespaces else "unshare of a mount and IPC namespace refused: no CAP_SYS_ADMIN?"
    why_uid = None if uid else "setresuid refused: no CAP_SETUID?"
    if uid and not namespaces and covers(needed_paths()):
        uid, why_uid = False, ("the interpreter's directories are closed to others and no mount namespace "
                               "can open them to a call")
    cgroup = _cgroup_usable()
    why_cgroup = None if cgroup else "no writable cgroup v2 or v1 with the memory and pids controllers"
    return Plan(uid, cgroup, namespaces, describe_gaps(uid=why_uid, cgroup=why_cgroup, namespaces=why_ns))


_PROBE = f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
ns = libc.unshare({CLONE_NEWNS | CLONE_NEWIPC}) == 0
ns = ns and libc.mount(b"none", b"/", None, {MS_REC | MS_PRIVATE}, None) == 0
shm = b"/dev/shm"
flags = {MS_NOSUID | MS_NODEV}
ns = ns and (not os.path.isdir(shm) or libc.mount(b"tmpfs", shm, b"tmpfs", flags, b"size=1m") == 0)
try:
    os.setgroups([]); os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534)
    uid = True
except OSError:
    uid = False
print(int(ns), int(uid))
"""


@functools.cache
def _probe() -> tuple[bool, bool]:
    """Whether a process of this host's root can take the namespaces and change uid (a root in a
    container without CAP_SYS_ADMIN cannot unshare). A fresh interpreter tries, never a fork of
    this (possibly multithreaded) process."""
    try:
        out = subprocess.run([sys.executable, "-I", "-S", "-c", _PROBE], capture_output=True, text=True,
                             timeout=30).stdout.split()
        return out[0] == "1", out[1] == "1"
    except (OSError, subprocess.SubprocessError, IndexError):
        return False, False


def _cgroup_usable() -> bool:
    from envs.sandbox import cgroup_version  # probes once per process (creates and removes one)

    return cgroup_version() is not None


class WorkerJail:
    """The pool's side: the uid and cgroup one worker's calls run in, held for the worker's life.
    ``release()`` (idempotent, thread-safe) kills everything in the cgroup and everything running
    as the uid, removes the cgroup and frees the uid."""

    def __init__(self, plan: Plan, memory_bytes: int):
        self.plan = plan
        self.lease: UidLease | None = None
        self.cgroup: SandboxCgroup | None = None
        self._lock = threading.Lock()
        if not plan.uid:
            return
        try:
            self.lease = UidLease()
            # A note in the lock file: if this process dies holding the uid, the next sandbox on the
            # host reclaims the uid's cgroup (``envs.sandbox._reclaim``: ``sb-<uid>``).
            self.lease.record("reward-calls")
            if plan.cgroup:
                self.cgroup = SandboxCgroup(f"sb-{self.lease.uid}", memory_bytes=memory_bytes or _NO_LIMIT,
                                            max_pids=CALL_MAX_PIDS)
        except BaseException:
            self.release()
            raise

    def argument(self, memory_bytes: int) -> str:
        """What the worker is started with (``--jail``): JSON for ``CallJail.from_argument``."""
        cg = self.cgroup
        dirs = {k: str(d) for k, d in cg.dirs.items()} if cg else {}
        return json.dumps({
            "uid": self.lease.uid if self.lease else None,
            "cgroup": {"version": cg.version, "dirs": dirs} if cg else None,
            "namespaces": self.plan.namespaces, "shm_bytes": memory_bytes or DEFAULT_SHM_BYTES})

    def release(self) -> None:
        with self._lock:
            lease, cgroup, self.lease, self.cgroup = self.lease, self.cgroup, None, None
        if cgroup is not None:
            cgroup.remove()  # kills what is left first
        if lease is not None:
            kill_uid(lease.uid)  # nothing can leave the cgroup unprivileged: this is belt and braces
            lease.release()


# ---------------------------------------------------------------- the worker's side


@dataclass
class CallJail:
    """The worker's side: what each call's child enters (``enter``) and what the worker clears
    between calls (``clear``)."""
    uid: int | None = None
    cgroup: SandboxCgroup | None = None
    namespaces: bool = False
    shm_bytes: int = DEFAULT_SHM_BYTES
    covers: list[tuple[str, list[str]]] = field(default_factory=list)

    @classmethod
    def from_argument(cls, text: str | None) -> CallJail:
        if not text:
            return cls()
        spec = json.loads(text)
        cg = spec.get("cgroup")
        jail = cls(uid=spec.get("uid"), namespaces=bool(spec.get("namespaces")),
                   shm_bytes=int(spec.get("shm_bytes") or DEFAULT_SHM_BYTES),
                   cgroup=SandboxCgroup.attach(cg["version"], cg["dirs"]) if cg else None)
        if jail.uid is not None and jail.namespaces:
            jail.covers = covers(needed_paths())
        return jail

    def oom_kills(self) -> int:
        return self.cgroup.oom_kills() if self.cgroup is not None else 0

    def clear(self) -> None:
        """Kill everything left in the cgroup (the call's setsid'd daemons included)."""
        if self.cgroup is not None:
            self.cgroup.kill()

    def enter(self, *, keep_root: bool) -> None:
        """In the call's child, as root, before the function runs; ``IsolationError`` if any step
        fails (the call is then not run)."""
        try:
            self.join_cgroup()
            self.private_namespaces()
            if self.uid is not None and not keep_root:
                self.cover_closed_dirs()
                self.drop_uid()
            _check(_libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        except OSError as e:
            raise IsolationError(f"{type(e).__name__}: {e}") from None

    # The steps of ``enter``, in its order (``benchmarks/bench_reward_calls.py`` times each).

    def join_cgroup(self) -> None:
        if self.cgroup is not None:
            for procs in self.cgroup.procs_files:
                with open(procs, "w") as f:
                    f.write(str(os.getpid()))

    def private_namespaces(self) -> None:
        """A mount and an IPC namespace of the call's own, with a fresh tmpfs on /dev/shm."""
        if self.namespaces:
            _check(_libc().unshare(CLONE_NEWNS | CLONE_NEWIPC), "unshare(mount, ipc)")
            _check(_libc().mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
            if os.path.isdir("/dev/shm"):
                _mount_tmpfs("/dev/shm", f"size={self.shm_bytes},mode=1777")

    def cover_closed_dirs(self) -> None:
        if self.namespaces:  # only ever in the call's own mount namespace
            for directory, names in self.covers:
                _cover(directory, names)

    def drop_uid(self) -> None:
        if self.uid is not None:
            os.setgroups([])
            os.setresgid(self.uid, self.uid, self.uid)
            os.setresuid(self.uid, self.uid, self.uid)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount_tmpfs(path: str, options: str) -> None:
    _check(_libc().mount(b"tmpfs", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options.encode()),
           f"mount a tmpfs on {path}")


def _cover(directory: str, names: list[str]) -> None:
    """Replace ``directory`` (closed to others) by a tmpfs holding binds of ``names`` only."""
    fds = [os.open(os.path.join(directory, n), os.O_PATH | os.O_CLOEXEC) for n in names]
    try:
        _mount_tmpfs(directory, "size=64k,mode=0755")
        for name, fd in zip(names, fds, strict=True):
            target = os.path.join(directory, name)
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                os.mkdir(target)
            else:
                os.close(os.open(target, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644))
            source = f"/proc/self/fd/{fd}".encode()
            _check(_libc().mount(source, target.encode(), None, MS_BIND | MS_REC, None), f"bind {target}")
    finally:
        for fd in fds:
            os.close(fd)


def needed_paths() -> list[str]:
    """The directories a call must reach to run Python and import lazily: the interpreter's
    prefixes and directory, every import path entry (a zip's directory) and the working directory."""
    found = [sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable)),
             *(p or os.getcwd() for p in sys.path), os.getcwd()]
    out = []
    for p in found:
        p = os.path.realpath(p)
        if not os.path.isdir(p):
            p = os.path.dirname(p)
        if os.path.isdir(p) and p not in out:
            out.append(p)
    return out


def _open_to_others(path: str, bits: int) -> bool:
    try:
        return os.stat(path).st_mode & bits == bits
    except OSError:
        return False


def covers(paths: list[str]) -> list[tuple[str, list[str]]]:
    """``(directory, [entries])`` to cover, parents first: each directory on the way to one of
    ``paths`` that others cannot enter, and the entries below it on the way to those paths."""
    found: dict[str, set[str]] = {}
    for path in paths:
        parts = Path(path).parts
        for depth in range(1, len(parts)):
            directory = str(Path(*parts[:depth]))
            if not _open_to_others(directory, stat.S_IXOTH):
                found.setdefault(directory, set()).add(parts[depth])
    return [(d, sorted(found[d])) for d in sorted(found, key=lambda d: (d.count("/"), d))]


def closed_paths(paths: list[str]) -> list[str]:
    """The ``paths`` that are themselves closed to others (no read or no search for "other"): a
    call cannot list or import from them even with its way there covered."""
    return [p for p in paths if not _open_to_others(p, stat.S_IROTH | stat.S_IXOTH)]
