"""Requests in flight versus weight reloads, for the server backends (issue 34, partial rollouts).

A server backend's ``generate`` runs in the sampler loop's main thread while its weights thread
calls ``load_weights``. With ``train.partial_rollouts`` off, a reload must wait until every request
this backend sent has finished on the old weights, and no new request may start until the reload
is done: ``ReloadGate.drained()``. With it on, the server pauses in place and the request spans the
reload; only the server's prefix cache, which then still holds keys/values of the old weights and
which the server refuses to flush while requests run, must be flushed once nothing is in flight:
``ReloadGate.when_idle(flush)``.

The gate sees only this backend's own requests (one sampler per server, as ``mixrl-sample``
starts it); another client of an attached server is not waited for.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator


class ReloadGate:
    """Counts requests in flight; ``drained()`` holds new ones back while a reload runs."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._inflight = 0
        self._draining = False

    @property
    def inflight(self) -> int:
        with self._cond:
            return self._inflight

    @property
    def draining(self) -> bool:
        """Whether a ``drained()`` block is waiting or running (tests watch it)."""
        with self._cond:
            return self._draining

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        """One request in flight for the block's duration; waits while a drained reload runs."""
        with self._cond:
            self._cond.wait_for(lambda: not self._draining)
            self._inflight += 1
        try:
            yield
        finally:
            with self._cond:
                self._inflight -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def drained(self) -> Iterator[None]:
        """Wait until no request is in flight, then keep new ones from starting until the block
        ends (one drained block at a time)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._draining)
            self._draining = True
            self._cond.wait_for(lambda: self._inflight == 0)
        try:
            yield
        finally:
            with self._cond:
                self._draining = False
                self._cond.notify_all()

    def when_idle(self, fn: Callable[[], bool]) -> bool:
        """Run ``fn`` now if nothing is in flight or draining (requests wait meanwhile) and return
        what it returns; ``False`` without running it otherwise."""
        with self._cond:
            if self._inflight or self._draining:
                return False
            return fn()


__all__ = ["ReloadGate"]
