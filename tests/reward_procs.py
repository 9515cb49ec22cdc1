"""Shared by the reward pool's tests (test_reward_workers, test_reward_isolation): waiting for
processes to die, and directories the calls (which run under uids of their own as root) can use."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from procs import proc_state


def alive(pid: int) -> bool:
    return proc_state(pid) not in (None, "Z")


def wait_dead(pids: list[int], within_s: float = 10.0) -> list[int]:
    """The ``pids`` still alive after up to ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def scratch_dir(prefix: str, mode: int) -> Iterator[Path]:
    """A root-owned directory of ``mode`` (0o1777: any uid writes, like /tmp; pytest's tmp_path
    sits under a 0700 directory, closed to the calls), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(mode)
    yield path
    shutil.rmtree(path, ignore_errors=True)
