"""Trainer-side rewards computed off the rollout service's RPC threads.

A reward function runs in a worker process (``envs.rewards.RewardPool``) and may take its whole
timeout; scored on the submit path, every slow call held one of the service's RPC threads, and a
few at once stalled leases, heartbeats and every other sampler's submissions. So a submission whose
task ``scores_slowly`` (its source says so: a dataset's reward function) is committed on the RPC
thread as before (lease checks, duplicates, byte backpressure, the ack all unchanged), and its
reward is filled in by a small pool of scoring threads. Its group stays out of the training
buffer until every sample of it is scored (``push_ready`` holds it), and the evaluation path
waits for its groups' scores (``wait_scored``), so no consumer ever sees a sample the service
has not scored. The backlog is bounded (``capacity`` samples): beyond it a submission is refused
with RESOURCE_EXHAUSTED like a full buffer, and the sampler retries with backoff.

The reward pools are the environments' own (built with the task source); ``max_abs_reward``
(``service.limits.max_abs_reward``) is set on the pool of each sample's environment before it is
scored, the training source's and the evaluation source's alike: a reward or metric beyond it
scores 0 as ``reward/errors/out_of_range``.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from envs.rewards import RewardPool
from trainer_jax.service.buffer import TrajectoryBuffer, TrajectoryGroup
from trainer_jax.service.tasks import TaskSource, TaskSpec
from trainer_jax.service.validation import TrajectoryRecord

log = logging.getLogger("mixrl.service")


def limit_reward_pool(spec: TaskSpec, max_abs_reward: float | None) -> None:
    """Give the reward pool of ``spec``'s environment the service's ``max_abs_reward`` (the
    environments build their pools with ``RewardPool``'s default, 1e6)."""
    env = spec.private[1] if isinstance(spec.private, tuple) and len(spec.private) == 2 else None
    pool = getattr(env, "reward", None)
    if max_abs_reward is not None and isinstance(pool, RewardPool) and pool.max_abs_reward != max_abs_reward:
        pool.max_abs_reward = float(max_abs_reward)


class ScoringBuffer(TrajectoryBuffer):
    """A ``TrajectoryBuffer`` whose groups wait for the rewards being computed for them."""

    def __init__(self, max_trajectories: int, max_bytes: int, *, source: TaskSource, threads: int = 8,
                 capacity: int | None = None, max_abs_reward: float | None = None):
        super().__init__(max_trajectories, max_bytes)
        self.source = source
        self.max_abs_reward = max_abs_reward  # None: each pool keeps its own
        self.capacity = capacity or max(64, 2 * max_trajectories)
        self._scoring = threading.Condition()
        self._pending: dict[int, TrajectoryRecord] = {}  # id(record) -> record, while it is scored
        self._waiting: list[TrajectoryGroup] = []  # complete groups with samples still pending
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="mixrl-score")
        self.scored = 0
        self.score_failures = 0

    def scores_slowly(self, spec: TaskSpec) -> bool:
        """Whether ``spec``'s samples are scored here, off the RPC thread."""
        probe = getattr(self.source, "scores_slowly", None)
        return bool(probe is not None and probe(spec))

    def hold(self, record: TrajectoryRecord) -> bool:
        """Reserve a place in the backlog for ``record`` (False: the backlog is full)."""
        with self._scoring:
            if len(self._pending) >= self.capacity:
                return False
            self._pending[id(record)] = record
            return True

    def score_later(self, spec: TaskSpec, record: TrajectoryRecord) -> None:
        """Score a held, committed ``record`` on a scoring thread."""
        limit_reward_pool(spec, self.max_abs_reward)
        self._executor.submit(self._score, spec, record)

    def _score(self, spec: TaskSpec, record: TrajectoryRecord) -> None:
        try:
            score = self.source.score(spec, record)
            if score is not None:
                record.reward = float(score)
        except Exception:  # a scorer bug scores 0; the sample still reaches its group
            log.exception("scoring task %s sample %s failed", record.task_id, record.sample_index)
            record.reward = 0.0
            with self._scoring:  # several scoring threads count
                self.score_failures += 1
        finally:
            with self._scoring:
                self.scored += 1
            self.release(record)

    def release(self, record: TrajectoryRecord) -> None:
        """``record`` is scored (or was never committed): push the groups it held back."""
        with self._scoring:
            self._pending.pop(id(record), None)
            ready = [g for g in self._waiting if not self._held(g)]
            self._waiting = [g for g in self._waiting if self._held(g)]
            self._scoring.notify_all()
        for group in ready:
            super().push_ready(group)

    def _held(self, group: TrajectoryGroup) -> bool:
        return any(id(t) in self._pending for t in group.trajectories)

    def push_ready(self, group: TrajectoryGroup) -> None:
        with self._scoring:
            if self._held(group):
                self._waiting.append(group)
                return
        super().push_ready(group)

    def wait_scored(self, groups: list[TrajectoryGroup], timeout: float) -> None:
        """Block until every sample of ``groups`` is scored; TimeoutError after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        with self._scoring:
            while any(self._held(g) for g in groups):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"rewards of {len(groups)} evaluation groups unfinished after "
                                       f"{timeout:.0f} s")
                self._scoring.wait(min(left, 1.0))

    def snapshot(self) -> dict[str, int]:
        snap = super().snapshot()
        with self._scoring:
            snap["scoring_samples"] = len(self._pending)
            snap["scoring_groups_held"] = len(self._waiting)
        snap["scored"], snap["score_failures"] = self.scored, self.score_failures
        return snap

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
