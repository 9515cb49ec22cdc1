"""Named fault points for the crash tests: freeze the trainer at an exact moment, then kill it.

Production runs never set ``MIXRL_FAULT_POINT`` and every call here returns at once. A test sets
``MIXRL_FAULT_POINT=<name>[:<n>]`` (the n-th time the point is reached, default the first) and
``MIXRL_FAULT_MARKER=<file>``; on reaching the point the process writes the marker (its pid and
the point's name) and stops itself with SIGSTOP, which freezes every thread at once (a background
publish or checkpoint commit included), so the test's SIGKILL lands while the work is in flight.
"""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

FAULT_ENV = "MIXRL_FAULT_POINT"
MARKER_ENV = "MIXRL_FAULT_MARKER"
POINTS = ("learner_step", "publish", "checkpoint")

_seen: Counter[str] = Counter()
_lock = threading.Lock()


def _armed(name: str) -> bool:
    spec = os.environ.get(FAULT_ENV, "")
    point, _, nth = spec.partition(":")
    return bool(spec) and point == name


def fault_point(name: str) -> None:
    """Freeze this process here if the test armed ``name`` (and this is the chosen occurrence)."""
    if not _armed(name):
        return
    nth = int(os.environ[FAULT_ENV].partition(":")[2] or 1)
    with _lock:
        _seen[name] += 1
        if _seen[name] != nth:
            return
    marker = os.environ.get(MARKER_ENV)
    if marker:
        tmp = f"{marker}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(f"{os.getpid()} {name}\n")
        os.replace(tmp, marker)
    os.kill(os.getpid(), signal.SIGSTOP)


def during(name: str, tensors: Mapping[str, Any]) -> Mapping[str, Any] | Callable[[], Iterator]:
    """``tensors`` for a publish, reaching fault point ``name`` halfway through when armed.

    Unarmed (every real run) it returns the mapping itself; armed, a callable source that yields
    half the tensors, so the version's temp directory is partly written when the process stops.
    """
    if not _armed(name):
        return tensors
    items = list(tensors.items())

    def source() -> Iterator:
        for i, item in enumerate(items):
            if i == len(items) // 2:
                fault_point(name)
            yield item

    return source
