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
