"""Named fault points for the crash tests: freeze the trainer at an exact moment, then kill it.

Production runs never set ``MIXRL_FAULT_POINT`` and every call here returns at once. A test sets
``MIXRL_FAULT_POINT=<name>[:<n>]`` (the n-th time the point is reached, default the first) and
``MIXRL_FAULT_MARKER=<file>``; on reaching the point the process writes the marker (its pid and
the point's name) and stops itself with SIGSTOP, which freezes every thread at once (a background
publish or checkpoint commit included), so the test's SIGKILL lands while the work is in flight.

``MIXRL_FAULT_HOLD=<name>[:<n>]`` holds only the thread that reaches the point (the rollout
service keeps serving): the process writes ``<marker>.hold`` and waits until the test removes it.
A test uses it to order events, e.g. to let an external sampler join before the run goes on.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from convert.atomic import atomic_write_text

FAULT_ENV = "MIXRL_FAULT_POINT"
MARKER_ENV = "MIXRL_FAULT_MARKER"
HOLD_ENV = "MIXRL_FAULT_HOLD"
POINTS = ("learner_step", "publish", "checkpoint")

_seen: Counter[str] = Counter()
_lock = threading.Lock()


def _chosen(env: str, name: str) -> int | None:
    """The occurrence of ``name`` that ``env`` arms (``None``: not armed)."""
    point, _, nth = os.environ.get(env, "").partition(":")
    return int(nth or 1) if point == name else None


def _armed(name: str) -> bool:
    return _chosen(FAULT_ENV, name) is not None


def fault_point(name: str) -> None:
    """Freeze this process here if the test armed ``name`` (and this is the chosen occurrence),
    or hold this thread here until the test releases it (``MIXRL_FAULT_HOLD``)."""
    stop, hold = _chosen(FAULT_ENV, name), _chosen(HOLD_ENV, name)
    if stop is None and hold is None:
        return
    with _lock:
        _seen[name] += 1
        seen = _seen[name]
    marker = os.environ.get(MARKER_ENV)
    if seen == hold and marker:
        atomic_write_text(f"{marker}.hold", f"{os.getpid()} {name}\n")
        while os.path.exists(f"{marker}.hold"):
            time.sleep(0.05)
    if seen == stop:
        if marker:
            atomic_write_text(marker, f"{os.getpid()} {name}\n")
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
