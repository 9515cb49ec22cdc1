"""Reading another process's state from /proc, shared by the tests that freeze, kill or wait for
processes (a sampler, a trainer stopped at a fault point, a reward worker)."""

from __future__ import annotations

from pathlib import Path


def proc_state(pid: int) -> str | None:
    """The /proc state letter of ``pid`` (``R``, ``S``, ``T`` stopped, ``Z`` zombie, ...); ``None``
    once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def group_alive(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``, from each ``/proc/PID/stat``."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # state, ppid, pgrp, ...
            alive.append(int(entry.name))
    return alive
