"""What ``--resume`` does to a run directory besides restoring the checkpoint, and what a fresh
run does to an earlier one (``set_aside_previous_run``).

A killed run leaves work done after its last checkpoint: weight versions published past the
checkpoint's version and metric records past its step. The resumed run retrains those steps from
the checkpoint, so that work belongs to a line of training that no longer exists. It is set aside,
never deleted and never mixed in:

- weight versions newer than the checkpoint's move to ``weights/discarded/`` (still named
  ``v########``), so ``LATEST`` and pruning see only the resumed line;
- metric records past the restored step move to ``metrics.discarded.jsonl``, so the metrics read
  as one run whose steps continue from the restored one.

Version numbers never go back: the resumed run publishes first the number after the highest ever
published in the run directory, discarded versions included. A sampler still holding a version
from before the crash compares numbers, so any smaller number would be taken for old weights and
ignored.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from pathlib import Path

from convert.atomic import atomic_write_text
from convert.publish import LATEST, list_versions, version_dirname

DISCARDED = "discarded"
METRICS_DISCARDED = "metrics.discarded.jsonl"
# Leftovers of a publish killed mid-write (convert.atomic's and convert.publish's temp names, a
# prune's rename before delete): hidden, never a version, only taking space.
_STALE_TEMP = re.compile(r"^\.((v\d{8,}|LATEST)\.(tmp|old|deleting)-|publish-v\d{8,}-)")
# Errors of the storage itself: retrying the next version cannot help, so the run stops.
STORAGE_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


class StorageError(RuntimeError):
    """The run directory cannot take more writes (disk full, file size limit, read-only)."""


def continue_versions(weights: Path, kept_version: int | None) -> tuple[int, list[int]]:
    """Set aside versions newer than ``kept_version`` (all of them if ``None``: nothing was
    restored); return the first version the resumed run publishes and the versions set aside."""
    discarded_dir = weights / DISCARDED
    highest = max([-1, *list_versions(weights), *list_versions(discarded_dir)]
                  + ([] if kept_version is None else [kept_version]))
    if not weights.is_dir():
        return highest + 1, []
    for p in weights.iterdir():
        if _STALE_TEMP.match(p.name):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    floor = -1 if kept_version is None else kept_version
    moved = [v for v in list_versions(weights) if v > floor]
    if moved:
        discarded_dir.mkdir(exist_ok=True)
    for v in moved:
        os.replace(weights / version_dirname(v), discarded_dir / version_dirname(v))
    kept = list_versions(weights)
    # LATEST must name a directory that exists until the resumed run publishes its first version.
    if kept:
        atomic_write_text(weights / LATEST, version_dirname(kept[-1]) + "\n")
    else:
        (weights / LATEST).unlink(missing_ok=True)
    return highest + 1, moved


def trim_metrics(run_dir: Path, last_step: int | None) -> int:
    """Keep the records of steps up to ``last_step`` (none if ``None``) in ``metrics.jsonl``;
    append the rest, and any torn line, to ``metrics.discarded.jsonl``. Return how many moved."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    keep, drop = [], []
    for line in path.read_text().splitlines():
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            drop.append(line)  # a line torn by the kill
            continue
        (keep if last_step is not None and step <= last_step else drop).append(line)
    if drop:
        with open(run_dir / METRICS_DISCARDED, "a") as f:
            f.write("".join(line + "\n" for line in drop))
        atomic_write_text(path, "".join(line + "\n" for line in keep))
    return len(drop)


def storage_failure(errors: list[str]) -> str | None:
    """The first publish error (``Publisher.errors`` text) caused by the storage, if any."""
    for err in errors:
        m = re.search(r"\[Errno (\d+)\]", err)
        if m and int(m.group(1)) in STORAGE_ERRNOS:
            return err
    return None


# What a run leaves in its directory; a fresh run finding any of them sets the old run aside.
_RUN_ARTIFACTS = ("checkpoints", "weights", "metrics.jsonl", "summary.json")


def set_aside_previous_run(run_dir: Path) -> Path | None:
    """Rename an earlier run in ``run_dir`` to ``<run_dir>.previous-<time>``; return where it went.

    A fresh run must not mix with an earlier one: its first weights (v0) would be the oldest
    version next to the earlier run's and be pruned at once, and checkpoints and metrics would
    interleave. Nothing is deleted; ``--resume`` continues the earlier run instead.
    """
    if not any((run_dir / name).exists() for name in _RUN_ARTIFACTS):
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = run_dir.with_name(f"{run_dir.name}.previous-{stamp}")
    n = 1
    while aside.exists():
        n += 1
        aside = run_dir.with_name(f"{run_dir.name}.previous-{stamp}-{n}")
    os.replace(run_dir, aside)
    return aside
