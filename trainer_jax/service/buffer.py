"""The trajectory buffer between the rollout service and the training loop.

Accepted samples are held per task until all G of them are in; the complete group then becomes
*ready* and ``take_groups`` hands ready groups to the trainer in completion order. The buffer is
bounded in samples and bytes (partial and ready groups together): the scheduler stops granting
leases when the sample bound is reached and rejects submissions with ``RESOURCE_EXHAUSTED`` when
the byte bound would be crossed, so memory never grows without limit however slow the trainer is.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time

from trainer_jax.service.tasks import TaskSpec
from trainer_jax.service.validation import TrajectoryRecord


@dataclasses.dataclass
class TrajectoryGroup:
    """All G samples of one task, ordered by sample index."""

    task_id: int
    task: TaskSpec
    trajectories: list[TrajectoryRecord]
    completed_unix: float

    @property
    def rewards(self) -> list[float | None]:
        return [t.reward for t in self.trajectories]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.trajectories)


class TrajectoryBuffer:
    """Bounded store of accepted samples; thread-safe.

    ``held_*`` count every accepted sample not yet taken (partial and ready groups);
    the scheduler also counts samples leased but not yet submitted against ``max_trajectories``.
    """

    def __init__(self, max_trajectories: int, max_bytes: int):
        self.max_trajectories = max_trajectories
        self.max_bytes = max_bytes
        self._cond = threading.Condition()
        self._ready: collections.deque[TrajectoryGroup] = collections.deque()
        self.held_trajectories = 0
        self.held_bytes = 0
        self.taken_groups = 0
        self.taken_trajectories = 0
        # How many groups each blocked taker waits for: a push wakes them only when the smallest
        # of these is reached, not once per group (each wake-up costs the submit path the GIL).
        self._needs: list[int] = []

    def fits(self, nbytes: int) -> bool:
        with self._cond:
            return self.held_bytes + nbytes <= self.max_bytes

    def add_sample(self, nbytes: int) -> None:
        with self._cond:
            self.held_trajectories += 1
            self.held_bytes += nbytes

    def push_ready(self, group: TrajectoryGroup) -> None:
        with self._cond:
            self._ready.append(group)
            if self._needs and len(self._ready) >= min(self._needs):
                self._cond.notify_all()

    @property
    def ready_groups(self) -> int:
        with self._cond:
            return len(self._ready)

    def take_groups(self, n: int, timeout: float | None = None) -> list[TrajectoryGroup]:
        """Up to ``n`` complete groups, oldest first.

        Blocks until ``n`` are ready or ``timeout`` seconds pass (``None``: wait for all ``n``;
        ``0``: take what is ready now); on timeout returns those ready, possibly none.
        """
        if n <= 0:
            return []
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._needs.append(n)
            try:
                while len(self._ready) < n:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        break
                    self._cond.wait(remaining)
            finally:
                self._needs.remove(n)
            out = [self._ready.popleft() for _ in range(min(n, len(self._ready)))]
            for g in out:
                self.held_trajectories -= len(g.trajectories)
                self.held_bytes -= g.nbytes
            self.taken_groups += len(out)
            self.taken_trajectories += sum(len(g.trajectories) for g in out)
            return out

    def snapshot(self) -> dict[str, int]:
        with self._cond:
            return {"held_trajectories": self.held_trajectories, "held_bytes": self.held_bytes,
                    "ready_groups": len(self._ready), "taken_groups": self.taken_groups,
                    "taken_trajectories": self.taken_trajectories,
                    "max_trajectories": self.max_trajectories, "max_bytes": self.max_bytes}
