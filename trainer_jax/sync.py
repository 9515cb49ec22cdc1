"""Synchronous mode (``train.sync: true``): step s learns only from samples of weights version s.

The asynchronous loop trains on whatever the buffer holds, so its per-token mismatch mixes policy
lag with precision. In synchronous mode the lag is removed and only precision and kernels remain:

1. ``SyncTasks`` stands between the task source and the rollout service. It hands out nothing
   until the trainer ``release`` s a version, then exactly P tasks of that version, each with
   ``TaskSpec.min_version`` set to it; the scheduler leases such a task only to a session whose
   heartbeat reports that version (samplers heartbeat right after loading one), so no task of
   step s is generated with older weights and the buffer never fills with stale groups.
2. The trainer publishes every step (``publish_every`` must be 1), synchronously, and releases
   the new version only once the service has announced it.
3. ``take`` checks every sample of every group: a group with any policy token of another
   version (a weight swap racing a generation) is dropped, counted, and replaced by a fresh
   task of the same version, so each step still trains on P groups, all of version s.

The async path does not construct any of this.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import numpy as np

from trainer_jax.service.tasks import TaskSource, TaskSpec


class SyncTasks:
    """A task source gated by weights version (see the module docstring).

    ``next_task`` returns None with ``waiting`` true while the current version's allowance is
    spent: "no task yet", which the scheduler must not read as an exhausted source.
    """

    def __init__(self, source: TaskSource, prompts_per_step: int):
        self.source = source
        self.prompts_per_step = prompts_per_step
        self.version: int | None = None
        self.left = 0
        self.dropped_groups = 0
        self.exhausted = False
        self._lock = threading.Lock()

    @property
    def waiting(self) -> bool:
        """True unless the wrapped source ran out (then ``next_task``'s None means exhausted)."""
        return not self.exhausted

    def release(self, version: int, count: int | None = None) -> None:
        """Allow ``count`` (default P) tasks of ``version``; a new version cancels what is left."""
        with self._lock:
            if self.version != version:
                self.version, self.left = version, 0
            self.left += self.prompts_per_step if count is None else count

    def next_task(self) -> TaskSpec | None:
        with self._lock:
            if self.version is None or self.left <= 0:
                return None
            spec = self.source.next_task()
            if spec is None:
                self.exhausted = True
                return None
            self.left -= 1
            return dataclasses.replace(spec, min_version=self.version)

    def score(self, task, record):
        return self.source.score(task, record)

    def __getattr__(self, name: str):
        # Everything else (vocab_size, metrics, cursor, close) is the wrapped source's.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.source, name)

    def take(self, take: Callable[[int], list], n: int, version: int) -> list:
        """``n`` complete groups generated entirely with ``version``, from ``take(k)`` calls.

        A group with a token of another version is dropped, counted in ``dropped_groups`` and
        replaced by a fresh task of ``version``.
        """
        kept: list = []
        while len(kept) < n:
            for group in take(n - len(kept)):
                if all_of_version(group, version):
                    kept.append(group)
                else:
                    self.dropped_groups += 1
                    self.release(version, 1)
        return kept


def all_of_version(group, version: int) -> bool:
    """Whether every policy token of every sample of ``group`` came from weights ``version``."""
    return all(bool(np.all(np.asarray(t.versions) == version)) for t in group.trajectories)


__all__ = ["SyncTasks", "all_of_version"]
