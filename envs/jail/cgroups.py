"""A memory and pids cgroup per sandbox: one ceiling on everything the sandbox starts.

rlimits bind one process (memory) or one uid host-wide (processes); a cgroup binds the sandbox:
memfd files, SysV shared memory and tmpfs pages are charged to the memory cgroup of the process that
touches them, and every process and thread the command starts counts against ``pids.max``. Killing
the cgroup kills everything in it, whatever session or process group it moved to.

cgroup v2 (one unified hierarchy with the ``memory`` and ``pids`` controllers): ``memory.max``,
``memory.swap.max`` = 0, ``pids.max``, ``cgroup.kill``. cgroup v1 (separate ``memory`` and ``pids``
hierarchies): ``memory.limit_in_bytes``, ``memory.memsw.limit_in_bytes`` where swap accounting is on,
``pids.max``, and a kill that signals ``cgroup.procs`` until it is empty. Each sandbox's cgroup is
``<parent>/sb-<uid>`` in every hierarchy, so a sandbox that a crashed process left behind is found
and emptied by the next owner of the uid. ``MIXRL_SANDBOX_CGROUP`` names the parent, relative to the
hierarchy's root (default ``mixrl-sandbox``; point it at a delegated subtree under systemd).
"""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path

DEFAULT_PARENT = "mixrl-sandbox"
CGROUP_ROOT = Path("/sys/fs/cgroup")


class CgroupError(RuntimeError):
    """A cgroup could not be created or configured."""


def _controllers_v2(root: Path) -> set[str]:
    try:
        return set((root / "cgroup.controllers").read_text().split())
    except OSError:
        return set()


def detect(root: Path = CGROUP_ROOT) -> tuple[str, dict[str, Path]] | None:
    """Which cgroup version can bound a sandbox here: ``("v2", {"unified": path})``,
    ``("v1", {"memory": path, "pids": path})`` or None. A hybrid host (v1 controllers plus an empty
    v2 tree at ``unified/``, like this one) is v1: the controllers live where they are mounted."""
    if {"memory", "pids"} <= _controllers_v2(root):
        return "v2", {"unified": root}
    v1 = {c: root / c for c in ("memory", "pids")}
    if (v1["memory"] / "memory.limit_in_bytes").exists() and (v1["pids"] / "cgroup.procs").exists():
        return "v1", v1
    return None


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as e:
        raise CgroupError(f"cannot write {value.strip()!r} to {path}: {e.strerror or e}") from None


def _pids(directory: Path) -> list[int]:
    try:
        return [int(x) for x in (directory / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


class SandboxCgroup:
    """The cgroup(s) of one sandbox: create with limits, hand ``procs_files`` to the launcher (its
    first process writes its pid there), ``kill()`` between and after runs, ``remove()`` at close."""

    def __init__(self, name: str, *, memory_bytes: int, max_pids: int, root: Path = CGROUP_ROOT,
                 parent: str | None = None, found: tuple[str, dict[str, Path]] | None = None):
        found = found or detect(root)
        if found is None:
            raise CgroupError(f"no cgroup with the memory and pids controllers under {root}")
        self.version, mounts = found
        parent = (parent or os.environ.get("MIXRL_SANDBOX_CGROUP") or DEFAULT_PARENT).strip("/")
        self.dirs = {key: mount / parent / name for key, mount in mounts.items()}
        self.memory_bytes, self.max_pids = memory_bytes, max_pids
        for key, directory in self.dirs.items():
            if directory.exists():  # left by a process that died holding this uid
                self._kill_dir(directory)
            try:
                if self.version == "v2":
                    self._enable_v2(mounts[key], parent)
                directory.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise CgroupError(f"cannot create the cgroup {directory}: {e.strerror or e}") from None
        self._configure()

    def _enable_v2(self, mount: Path, parent: str) -> None:
        """Enable memory and pids for the children of each level down to ``parent`` (v2 distributes
        a controller to a cgroup only when its parent lists it in ``cgroup.subtree_control``)."""
        level = mount
        for part in [""] + parent.split("/"):
            level = level / part if part else level
            level.mkdir(exist_ok=True)
            control = level / "cgroup.subtree_control"
            have = set(control.read_text().split()) if control.exists() else set()
            if not {"memory", "pids"} <= have:
                _write(control, "+memory +pids")

    def _configure(self) -> None:
        if self.version == "v2":
            d = self.dirs["unified"]
            _write(d / "memory.max", str(self.memory_bytes))
            if (d / "memory.swap.max").exists():
                _write(d / "memory.swap.max", "0")
            _write(d / "pids.max", str(self.max_pids))
            return
        mem = self.dirs["memory"]
        memsw = mem / "memory.memsw.limit_in_bytes"
        if memsw.exists():  # memsw >= memory at every moment: lower memory first, raise memsw last
            _write(memsw, str(max(self.memory_bytes, _read_int(mem / "memory.limit_in_bytes"))))
        _write(mem / "memory.limit_in_bytes", str(self.memory_bytes))
        if memsw.exists():
            _write(memsw, str(self.memory_bytes))
        _write(self.dirs["pids"] / "pids.max", str(self.max_pids))

    @classmethod
    def attach(cls, version: str, dirs: dict[str, Path]) -> SandboxCgroup:
        """The cgroup(s) another process created (``version``, ``dirs``), to join, kill or read,
        never to configure: a reward worker kills the cgroup its pool made for its calls."""
        self = cls.__new__(cls)
        self.version, self.dirs = version, {key: Path(d) for key, d in dirs.items()}
        self.memory_bytes = self.max_pids = 0
        return self

    def oom_kills(self) -> int:
        """How many processes the kernel's OOM killer has killed in this cgroup so far (v2
        ``memory.events``, v1 ``memory.oom_control``; 0 where the kernel does not say)."""
        key = "unified" if self.version == "v2" else "memory"
        name = "memory.events" if self.version == "v2" else "memory.oom_control"
        try:
            lines = (self.dirs[key] / name).read_text().splitlines()
        except (OSError, KeyError):
            return 0
        for line in lines:
            field, _, value = line.partition(" ")
            if field == "oom_kill" and value.strip().isdigit():
                return int(value)
        return 0

    @property
    def procs_files(self) -> list[Path]:
        """Where a process writes its pid to join this sandbox's cgroup(s)."""
        return [d / "cgroup.procs" for d in self.dirs.values()]

    def pids(self) -> list[int]:
        """The host pids of every process in the sandbox now."""
        return sorted({p for d in self.dirs.values() for p in _pids(d)})

    def kill(self, timeout: float = 5.0) -> bool:
        """SIGKILL everything in the cgroup(s); True once they are empty."""
        return all(self._kill_dir(d, timeout) for d in self.dirs.values())

    def _kill_dir(self, directory: Path, timeout: float = 5.0) -> bool:
        kill_file = directory / "cgroup.kill"
        if self.version == "v2" and kill_file.exists():
            try:
                kill_file.write_text("1")
            except OSError:
                pass
        # v1 (or a v2 kernel before 5.14): signal what is listed until nothing is. A process forked
        # between the read and the kill is in the next read; pids.max bounds how many there can be.
        deadline = time.monotonic() + timeout
        while pids := _pids(directory):
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def remove(self) -> None:
        """Kill what is left and delete the cgroup directories (best effort; idempotent)."""
        self.kill()
        for directory in self.dirs.values():
            for _ in range(50):
                try:
                    directory.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        break  # ENOTEMPTY on a plain directory (a test's fake tree): leave it
                    self._kill_dir(directory, 0.1)  # something joined or is still exiting


def remove_stale(name: str, *, root: Path = CGROUP_ROOT, parent: str | None = None) -> None:
    """Empty and delete the cgroup(s) ``name`` a dead owner left behind, if there are any."""
    found = detect(root)
    if found is None:
        return
    parent = (parent or os.environ.get("MIXRL_SANDBOX_CGROUP") or DEFAULT_PARENT).strip("/")
    for mount in found[1].values():
        directory = mount / parent / name
        if directory.is_dir():
            deadline = time.monotonic() + 2.0
            while (pids := _pids(directory)) and time.monotonic() < deadline:
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.002)
            try:
                directory.rmdir()
            except OSError:
                pass


def _read_int(path: Path) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
