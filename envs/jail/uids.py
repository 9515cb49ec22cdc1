"""A distinct uid per live sandbox, from a host-wide range, with a lock file per uid.

``RLIMIT_NPROC`` counts a uid host-wide, and signals and ``/proc`` access go by uid: when every
sandbox ran as ``nobody``, one episode's fork bomb or leftovers made every other episode fail to
fork, and sandboxes could signal each other. Each sandbox now holds one uid of
``[base, base + count)`` (default 0x60000000 + 0..1023; ``MIXRL_SANDBOX_UID_BASE`` / ``_COUNT``) for its
life. The lease is an ``flock`` on ``<lock dir>/<uid>.lock`` (default ``/run/mixrl-sandbox/uids``,
``MIXRL_SANDBOX_UID_LOCK_DIR``): two samplers or two test workers allocating at once get different
uids, and a process that dies releases its uids with its descriptors. A new holder kills whatever
still runs as the uid (a sandbox whose owner was SIGKILLed) before using it, so the range must be
one no user and no ``/etc/subuid`` / ``/etc/subgid`` map uses: the base must be at least 65536, a
range overlapping a map in those files is refused in one line, and the default sits far above the
maps ``useradd`` hands out (100000 + 65536 per user).
"""

from __future__ import annotations

import fcntl
import os
import signal
from collections.abc import Callable
from pathlib import Path

DEFAULT_BASE, DEFAULT_COUNT = 0x6000_0000, 1024
MIN_BASE = 65_536
DEFAULT_LOCK_DIR = Path("/run/mixrl-sandbox/uids")


def subordinate_overlap(base: int, count: int,
                        files: tuple[str, ...] = ("/etc/subuid", "/etc/subgid")) -> str | None:
    """The first ``/etc/subuid`` / ``/etc/subgid`` map (``name:start:count``) that meets
    ``[base, base + count)``, as ``"file: line"``, or None. Those ids belong to users' rootless
    containers: a sandbox taking one would kill their processes."""
    for path in files:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            parts = line.strip().split(":")
            if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
                continue
            start, n = int(parts[1]), int(parts[2])
            if start < base + count and base < start + n:
                return f"{path}: {line.strip()}"
    return None


class UidsExhausted(RuntimeError):
    """Every uid of the range is held by a live sandbox."""


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r} must be positive")
    return value


class UidLease:
    """Holds one uid of the range until ``release()``; ``uid`` is also its gid in the jail."""

    def __init__(self, *, base: int | None = None, count: int | None = None, lock_dir: Path | None = None):
        self.base = base if base is not None else _env_int("MIXRL_SANDBOX_UID_BASE", DEFAULT_BASE)
        self.count = count if count is not None else _env_int("MIXRL_SANDBOX_UID_COUNT", DEFAULT_COUNT)
        if self.base < MIN_BASE or self.count < 1:
            # Everything running as a uid of the range is killed when a sandbox takes it.
            raise ValueError(f"sandbox uid range {self.base}+{self.count}: the base must be >= {MIN_BASE} "
                             "(above every ordinary user) and the count >= 1")
        if (clash := subordinate_overlap(self.base, self.count)) is not None:
            raise ValueError(f"sandbox uid range {self.base}+{self.count} overlaps a subordinate id map "
                             f"({clash}): set MIXRL_SANDBOX_UID_BASE to a free range")
        self.lock_dir = Path(lock_dir or os.environ.get("MIXRL_SANDBOX_UID_LOCK_DIR") or DEFAULT_LOCK_DIR)
        self.lock_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._fd: int | None = None
        self.uid = -1
        self.previous = ""  # the note a holder that died left behind (see ``record``)
        # Start at a pid-dependent offset so concurrent allocators rarely contend for the same file.
        start = os.getpid() % self.count
        for i in range(self.count):
            uid = self.base + (start + i) % self.count
            fd = os.open(self.lock_dir / f"{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._fd, self.uid = fd, uid
            self.previous = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            kill_uid(uid)
            return
        last = self.base + self.count - 1
        raise UidsExhausted(f"all {self.count} sandbox uids {self.base}..{last} are held by live sandboxes "
                            f"(locks in {self.lock_dir}); raise MIXRL_SANDBOX_UID_COUNT")

    def record(self, note: str) -> None:
        """Keep a note in the lock file (the sandbox's directory): if this process dies holding the
        uid, the next holder reads it as ``previous`` and cleans up after it."""
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, note.encode(), 0)

    def reclaim_orphans(self, clean: Callable[[int, str], None]) -> int:
        """Clean up after every holder that died without releasing (its note is still in its lock
        file, and the lock is free): kill what runs as its uid, ``clean(uid, note)``, clear the note.
        Called by each new sandbox, so a dead owner's mounts and directories do not wait for its
        uid to come round again. Returns how many it reclaimed."""
        reclaimed = 0
        for entry in os.scandir(self.lock_dir):
            try:
                uid = int(entry.name.removesuffix(".lock"))
                if uid == self.uid or not entry.name.endswith(".lock") or entry.stat().st_size == 0:
                    continue
                fd = os.open(entry.path, os.O_RDWR | os.O_CLOEXEC)
            except (ValueError, OSError):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue  # a live sandbox
            try:
                note = os.pread(fd, 4096, 0).decode(errors="replace").strip()
                kill_uid(uid)
                clean(uid, note)
                os.ftruncate(fd, 0)
                reclaimed += 1
            finally:
                os.close(fd)
        return reclaimed

    def release(self) -> None:
        """Give the uid back (idempotent); call after everything running as it is dead."""
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # released cleanly: nothing for the next holder to clean
            os.close(self._fd)
            self._fd = None


def uid_processes(uid: int) -> list[int]:
    """Pids of the processes whose real, effective or saved uid is ``uid``."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"State:") and b"Z" in line.split()[1:2]:
                        break  # a zombie: dead already, its parent reaps it
                    if line.startswith(b"Uid:"):
                        if str(uid).encode() in line.split()[1:4]:
                            found.append(int(entry.name))
                        break
        except OSError:
            continue
    return found


def kill_uid(uid: int, rounds: int = 50) -> None:
    """SIGKILL every process running as ``uid`` (never root's: the range starts far above 0)."""
    if uid <= 0:
        raise ValueError("refusing to kill by uid 0")
    for _ in range(rounds):
        pids = uid_processes(uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
