"""Sessions, the task queue and leases: who may generate what, and until when.

Work is handed out in *items*: a task id plus the sample indices to generate. With group pinning
an item is all G samples of a prompt (one lease, one sampler group); without it each sample is its
own item. A lease ends when all its samples are accepted, at its deadline, or when its session
goes silent for ``session_ttl_s``; its unfinished samples then go back to the *front* of the
queue, so partial groups complete first. A sample is accepted at most once: a submission must
come from the session holding a live lease that still lists the sample. A retry of an accepted
sample on the same lease is acknowledged as a duplicate and not counted again.

A training task with ``TaskSpec.min_version`` > 0 (synchronous mode, ``trainer_jax.sync``) is
leased only to a session whose heartbeat reports that weights version or a newer one.

Evaluation tasks (``TaskSpec.evaluation``) ride the same leases and submissions: they wait in
their own queue, are granted first to a session of their ``group`` holding weights
``min_version`` or newer, do not count against the training buffer or the router's quotas, and
their complete groups go to ``eval_results`` instead of the buffer, so nothing evaluated is ever
trained on.

All state sits behind one lock. Content validation (``validation.py``) runs outside it, between
``begin_submit`` (snapshot of the lease and task) and ``finish_submit`` (re-checked, committed).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable

import grpc

from mixrl_wire import pb
from trainer_jax.config import ServiceConfig
from trainer_jax.service.buffer import TrajectoryBuffer, TrajectoryGroup
from trainer_jax.service.router import Router
from trainer_jax.service.sessions import Duplicate, Lease, Rejected, Session, TaskState, registration_fields
from trainer_jax.service.tasks import TaskSource, TaskSpec
from trainer_jax.service.validation import TrajectoryRecord, ValidationContext

# How many finished (lease, sample) pairs and expired lease ids are remembered, for duplicate acks
# and clearer rejections. Forgetting one only changes an ack into a rejection; never double counts.
_MEMORY = 200_000
_RETRY_MS_BUSY = 200
_RETRY_MS_EMPTY = 1000
log = logging.getLogger("mixrl.service")


class Scheduler:
    def __init__(self, source: TaskSource, buffer: TrajectoryBuffer, router: Router, cfg: ServiceConfig,
                 vocab_size: int, clock: Callable[[], float] = time.monotonic):
        self.source = source
        self.buffer = buffer
        self.router = router
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.clock = clock
        self.lock = threading.RLock()
        self.sessions: dict[str, Session] = {}
        self.leases: dict[str, Lease] = {}
        self.tasks: dict[int, TaskState] = {}
        self.pending: collections.deque[tuple[int, tuple[int, ...]]] = collections.deque()
        self.pending_samples = 0
        self.outstanding = 0  # training samples leased and not yet accepted
        self.eval_pending: collections.deque[tuple[int, tuple[int, ...]]] = collections.deque()
        self.eval_results: dict[int, TrajectoryGroup] = {}
        self._eval_done = threading.Condition(self.lock)
        self.exhausted = False
        self.current_version = 0
        self._next_task_id = 1
        self._done: collections.OrderedDict[tuple[str, int], str] = collections.OrderedDict()
        self._expired: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.totals = collections.Counter()
        self.max_support: int | None = None  # train.support_k (RolloutService.from_config)
        #: called with each new session once it is registered, outside the lock (the trainer's
        #: console line, ``trainer_jax.waits``); a listener that fails is never the sampler's problem
        self.on_register: list[Callable[[Session], None]] = []

    # ---------------------------------------------------------------- sessions

    def register(self, req: pb.RegisterRequest, peer: str) -> Session:
        recipe, device = registration_fields(req)
        with self.lock:
            s = Session(id=secrets.token_hex(16), name=req.name or peer, group=req.group, recipe=recipe,
                        accelerator=req.accelerator, capacity=int(req.capacity),
                        weight_formats=tuple(req.weight_formats), peer=peer, last_seen=self.clock(),
                        device=device)
            self.sessions[s.id] = s
            g = self.router.group(s.group)
            g.samplers += 1
            g.capacity += s.capacity
            self.totals["sessions"] += 1
        for listener in list(self.on_register):
            try:
                listener(s)
            except Exception:  # noqa: BLE001 - a console line must not refuse a registration
                log.exception("registration listener failed for sampler %s", s.name)
        return s

    def unserved_formats(self, published: list[str]) -> list[str]:
        """The most preferred weight format of each live session that loads none of ``published``.

        A group that joins asking for a format nobody publishes gets it from the next version on.
        """
        with self.lock:
            wanted = [s.weight_formats[0] for s in self.sessions.values()
                      if s.weight_formats and not s.revoked and not set(s.weight_formats) & set(published)]
            return list(dict.fromkeys(wanted))

    def max_outstanding(self, s: Session) -> int:
        return min(s.capacity, self.cfg.limits.max_outstanding_per_sampler)

    def touch(self, session_id: str) -> Session:
        """The live session ``session_id``, marked as seen; ``Rejected`` if unknown or revoked."""
        with self.lock:
            s = self.sessions.get(session_id)
            if s is None:
                raise Rejected(grpc.StatusCode.NOT_FOUND, "session_id",
                               "unknown or expired session (register again)")
            if s.revoked:
                raise Rejected(grpc.StatusCode.PERMISSION_DENIED, "session_id",
                               f"session revoked: {s.revoked_reason or 'revoked'}")
            s.last_seen = self.clock()
            return s

    def heartbeat(self, req: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        with self.lock:
            s = self.touch(req.session_id)
            s.weights_version = req.weights_version
            s.weight_failures = req.weight_failures
            s.active_samples = req.active_samples
            expired, s.expired_unreported = s.expired_unreported, []
            return pb.HeartbeatResponse(current_version=self.current_version, expired_lease_ids=expired)

    def _drop_session(self, s: Session, why: str) -> None:
        for lease_id in list(s.leases):
            self._end_lease(self.leases[lease_id], why)
        del self.sessions[s.id]
        g = self.router.group(s.group)
        g.samplers -= 1
        g.capacity -= s.capacity
        self.totals["sessions_expired"] += 1

    # ---------------------------------------------------------------- leases

    def _refill(self, want: int) -> None:
        while self.pending_samples < want and not self.exhausted:
            spec = self.source.next_task()
            if spec is None:
                # A gated source (trainer_jax.sync) has no task *yet*: not the end of the stream.
                self.exhausted = not getattr(self.source, "waiting", False)
                break
            task_id = self._next_task_id
            self._next_task_id += 1
            self.tasks[task_id] = TaskState(spec)
            indices = tuple(range(spec.group_size))
            if self.cfg.router.pin_groups:
                self.pending.append((task_id, indices))
            else:
                self.pending.extend((task_id, (i,)) for i in indices)
            self.pending_samples += spec.group_size

    def lease(self, req: pb.LeaseRequest) -> pb.LeaseResponse:
        with self.lock:
            s = self.touch(req.session_id)
            held = self.buffer.held_trajectories
            free = self.buffer.max_trajectories - held - self.outstanding
            session_room = self.max_outstanding(s) - s.outstanding
            group = self.router.group(s.group)
            quota = self.router.quota(s.group, self.buffer.max_trajectories - held, unit=1)
            room = min(max(req.max_samples, 1), session_room, quota - group.outstanding, free)
            self._refill(max(room, 1))
            now, now_unix = self.clock(), time.time()
            tasks = self._lease_evaluations(s, session_room, now, now_unix)
            room -= sum(len(t.sample_indices) for t in tasks)
            if self.router.is_eval_only(s.group):
                # An evaluation-only group (groups[].eval_only) never leases training tasks.
                if tasks:
                    return pb.LeaseResponse(tasks=tasks)
                return pb.LeaseResponse(retry_after_ms=_RETRY_MS_BUSY, reason=f"group {s.group!r} is "
                                        "evaluation-only: no evaluation task for it now")
            while self.pending:
                task_id, indices = self.pending[0]
                size = len(indices)
                # A pinned group larger than the session's room is still granted whole to a session
                # holding nothing, so a sampler of capacity < G is not starved; the buffer bound holds.
                whole_group_ok = not tasks and s.outstanding == 0 and size <= free and session_room > 0
                if ((size > room and not whole_group_ok) or self._too_old(s, task_id)
                        or self._unrunnable(s, task_id)):
                    break
                self.pending.popleft()
                self.pending_samples -= size
                room -= size
                free -= size
                tasks.append(self._grant(s, task_id, indices, now, now_unix))
            if tasks:
                return pb.LeaseResponse(tasks=tasks)
            if not self.pending and self.exhausted:
                return pb.LeaseResponse(retry_after_ms=_RETRY_MS_EMPTY, reason="no more tasks")
            why = ("buffer full: the trainer has not taken enough groups" if free <= 0 else
                   "waiting for a sampler holding the tasks' weights version"
                   if self.pending and self._too_old(s, self.pending[0][0]) else
                   f"waiting for a sampler that can run environment "
                   f"{self.tasks[self.pending[0][0]].spec.env!r}"
                   if self.pending and self._unrunnable(s, self.pending[0][0]) else
                   "session at its outstanding limit" if session_room <= 0 else
                   f"group {s.group!r} at its router quota ({quota})")
            return pb.LeaseResponse(retry_after_ms=_RETRY_MS_BUSY, reason=why)

    def _too_old(self, s: Session, task_id: int) -> bool:
        """A training task with a ``min_version`` (synchronous mode) waits for a session that
        reports holding that version; tasks without one (0, the async path) go to anyone."""
        need = self.tasks[task_id].spec.min_version
        return need > 0 and s.weights_version < need

    def _unrunnable(self, s: Session, task_id: int) -> bool:
        """The session gave back a lease of this task's environment (``return_lease``)."""
        return bool(s.unrunnable_envs) and self.tasks[task_id].spec.env in s.unrunnable_envs

    def return_lease(self, req: pb.ReturnLeaseRequest) -> pb.ReturnLeaseResponse:
        """A sampler gives back a live lease of its own: its samples go back to the front of the
        queue now (not at the deadline), counted per reason; with ``env``, the session is not
        leased that environment's tasks again."""
        with self.lock:
            s = self.touch(req.session_id)
            lease = self.leases.get(req.lease_id)
            if lease is None or lease.session_id != s.id:
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "lease_id",
                               "not a live lease of this session")
            reason = "".join(c for c in (req.reason or "unspecified")[:64] if c.isprintable())
            n = len(lease.remaining)
            self._end_lease(lease, "")  # the sampler knows: not reported back as expired
            s.returned[reason] += n
            self.totals["returned_samples"] += n
            if req.env:
                s.unrunnable_envs.add(req.env[:128])
            return pb.ReturnLeaseResponse(requeued=n)

    def _lease_evaluations(self, s: Session, room: int, now: float, now_unix: float) -> list[pb.Task]:
        """Grant the evaluation items this session may run, whole, within its ``room``."""
        tasks: list[pb.Task] = []
        for item in list(self.eval_pending):
            task_id, indices = item
            spec = self.tasks[task_id].spec
            if (spec.group not in (None, s.group) or s.weights_version < spec.min_version
                    or spec.env in s.unrunnable_envs):
                continue
            if len(indices) > room and (tasks or s.outstanding):
                break
            self.eval_pending.remove(item)
            room -= len(indices)
            tasks.append(self._grant(s, task_id, indices, now, now_unix))
        return tasks

    def _grant(self, s: Session, task_id: int, indices: tuple[int, ...], now: float,
               now_unix: float) -> pb.Task:
        ttl = self.cfg.lease_ttl_s
        spec = self.tasks[task_id].spec
        lease = Lease(id=secrets.token_hex(12), session_id=s.id, group=s.group, task_id=task_id,
                      indices=indices, remaining=set(indices), deadline=now + ttl,
                      deadline_unix=now_unix + ttl, granted=now, evaluation=spec.evaluation)
        self.leases[lease.id] = lease
        s.leases.add(lease.id)
        s.outstanding += len(indices)
        if not lease.evaluation:
            self.outstanding += len(indices)
            self.router.group(s.group).outstanding += len(indices)
        return pb.Task(lease_id=lease.id, task_id=task_id, sample_indices=list(indices),
                       group_size=spec.group_size, prompt_ids=list(spec.prompt_ids), env=spec.env,
                       payload=spec.payload, sampling=spec.sampling.to_pb(),
                       deadline_unix_ms=int(lease.deadline_unix * 1000))

    def _end_lease(self, lease: Lease, why: str) -> None:
        """Remove ``lease``; its unfinished samples go back to the front of the queue."""
        del self.leases[lease.id]
        s = self.sessions.get(lease.session_id)
        left = tuple(sorted(lease.remaining))
        if s is not None:
            s.leases.discard(lease.id)
            s.outstanding -= len(left)
            if why:
                s.expired_unreported.append(lease.id)
        if why:
            self._remember(self._expired, lease.id, why)
        if lease.evaluation:
            if left:
                self.eval_pending.appendleft((lease.task_id, left))
                self.totals["requeued_eval_samples"] += len(left)
            return
        self.outstanding -= len(left)
        self.router.group(lease.group).outstanding -= len(left)
        if left:
            if self.cfg.router.pin_groups:
                self.pending.appendleft((lease.task_id, left))
            else:
                self.pending.extendleft((lease.task_id, (i,)) for i in reversed(left))
            self.pending_samples += len(left)
            self.totals["requeued_samples"] += len(left)

    def expire(self) -> None:
        """Drop silent sessions and end overdue leases (the reaper thread calls this)."""
        with self.lock:
            now = self.clock()
            for s in list(self.sessions.values()):
                if now - s.last_seen > self.cfg.session_ttl_s:
                    self._drop_session(s, "session expired")
            for lease in list(self.leases.values()):
                if now > lease.deadline:
                    self._end_lease(lease, "lease deadline passed")

    @staticmethod
    def _remember(memory: collections.OrderedDict, key, value) -> None:
        memory[key] = value
        if len(memory) > _MEMORY:
            memory.popitem(last=False)

    # ---------------------------------------------------------------- submissions

    def begin_submit(self, msg: pb.Trajectory) -> tuple[Session, TaskSpec, ValidationContext]:
        """Check the lease side of a submission; return what its content is validated against.

        Raises ``Duplicate`` for a retry of an accepted sample, ``Rejected`` otherwise.
        """
        with self.lock:
            s = self.touch(msg.session_id)
            lease = self._check_lease(s, msg)
            spec = self.tasks[lease.task_id].spec
            ctx = ValidationContext(
                vocab_size=self.vocab_size, head_k=spec.sampling.head_k,
                truncation=spec.sampling.truncates(self.vocab_size),
                max_tokens=self.cfg.limits.max_trajectory_tokens, max_policy_tokens=spec.max_policy_tokens,
                current_version=self.current_version, max_support=self.max_support)
            return s, spec, ctx

    def _check_lease(self, s: Session, msg: pb.Trajectory) -> Lease:
        lease = self.leases.get(msg.lease_id)
        if lease is None:
            if self._done.get((msg.lease_id, msg.sample_index)) == s.id:
                s.duplicates += 1
                self.totals["duplicates"] += 1
                raise Duplicate()
            why = self._expired.get(msg.lease_id)
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "lease_id",
                           f"lease ended ({why}); its samples were re-queued" if why else
                           "unknown lease (finished, or never granted)")
        if lease.session_id != s.id:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "lease_id", "leased to another sampler")
        if msg.task_id != lease.task_id:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "task_id",
                           f"task {msg.task_id} is not the task of this lease ({lease.task_id})")
        if msg.sample_index not in lease.indices:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "sample_index",
                           f"sample {msg.sample_index} is not part of this lease {list(lease.indices)}")
        if msg.sample_index not in lease.remaining:
            s.duplicates += 1
            self.totals["duplicates"] += 1
            raise Duplicate()
        return lease

    def count_rejection(self, session_id: str, field: str) -> None:
        with self.lock:
            self.totals["rejected"] += 1
            s = self.sessions.get(session_id)
            if s is None:
                return
            s.rejected += 1
            s.rejections[field] += 1
            if s.rejected >= self.cfg.limits.max_rejections_per_sampler and not s.revoked:
                self._revoke(s, f"{s.rejected} rejected submissions")

    def revoke(self, session_id: str, reason: str) -> None:
        """Refuse every later call of ``session_id`` (PERMISSION_DENIED naming ``reason``) and
        put its leases back in the queue."""
        with self.lock:
            s = self.sessions.get(session_id)
            if s is not None and not s.revoked:
                self._revoke(s, reason)

    def _revoke(self, s: Session, reason: str) -> None:
        s.revoked, s.revoked_reason = True, reason
        self._drop_leases(s, "session revoked")

    def _drop_leases(self, s: Session, why: str) -> None:
        for lease_id in list(s.leases):
            self._end_lease(self.leases[lease_id], why)

    def finish_submit(self, msg: pb.Trajectory, record: TrajectoryRecord, s: Session) -> None:
        """Commit a validated sample: exactly once, or ``Duplicate`` / ``Rejected``."""
        with self.lock:
            s = self.touch(s.id)
            lease = self._check_lease(s, msg)  # it may have expired, or a racing retry won
            if not lease.evaluation and not self.buffer.fits(record.nbytes):
                self.totals["backpressure"] += 1
                raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED, "",
                               "trajectory buffer full (bytes): retry later")
            record.session_id, record.sampler_name, record.group = s.id, s.name, s.group
            record.recipe = dict(s.recipe)
            record.received_unix = time.time()
            lease.remaining.discard(msg.sample_index)
            s.outstanding -= 1
            s.accepted += 1
            self.router.record(s.group, record.num_policy_tokens, evaluation=lease.evaluation)
            self._remember(self._done, (lease.id, msg.sample_index), s.id)
            if lease.evaluation:
                self.totals["accepted_eval"] += 1
            else:
                self.outstanding -= 1
                self.router.group(s.group).outstanding -= 1
                self.totals["accepted"] += 1
                self.buffer.add_sample(record.nbytes)
            if not lease.remaining:
                self._end_lease(lease, "")
            task = self.tasks[lease.task_id]
            task.accepted[msg.sample_index] = record
            if len(task.accepted) == task.spec.group_size:
                del self.tasks[lease.task_id]
                trajs = [task.accepted[i] for i in sorted(task.accepted)]
                group = TrajectoryGroup(lease.task_id, task.spec, trajs, time.time())
                if lease.evaluation:
                    self.eval_results[lease.task_id] = group
                    self._eval_done.notify_all()
                else:
                    self.buffer.push_ready(group)

    # ---------------------------------------------------------------- evaluation

    def add_evaluation(self, specs: list[TaskSpec]) -> list[int]:
        """Queue evaluation tasks (``spec.evaluation`` set); return their task ids."""
        with self.lock:
            ids = []
            for spec in specs:
                if not spec.evaluation:
                    raise ValueError("add_evaluation takes evaluation tasks (TaskSpec.evaluation=True)")
                task_id = self._next_task_id
                self._next_task_id += 1
                self.tasks[task_id] = TaskState(spec)
                self.eval_pending.append((task_id, tuple(range(spec.group_size))))
                ids.append(task_id)
            return ids

    def wait_evaluation(self, task_ids: list[int], timeout: float) -> list[TrajectoryGroup]:
        """The complete groups of ``task_ids``, in that order, once all are in.

        Raises ``TimeoutError`` (and withdraws the unfinished tasks) after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        with self.lock:
            while not all(t in self.eval_results for t in task_ids):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [t for t in task_ids if t not in self.eval_results]
                    self._withdraw_evaluation(task_ids)
                    raise TimeoutError(f"{len(missing)} of {len(task_ids)} evaluation tasks unfinished "
                                       f"after {timeout:.0f} s")
                self._eval_done.wait(min(left, 1.0))
            return [self.eval_results.pop(t) for t in task_ids]

    def _withdraw_evaluation(self, task_ids: list[int]) -> None:
        ids = set(task_ids)
        for lease in [le for le in self.leases.values() if le.task_id in ids]:
            self._end_lease(lease, "evaluation withdrawn")  # a late submission is then refused
        self.eval_pending = collections.deque(i for i in self.eval_pending if i[0] not in ids)
        for t in ids:
            self.tasks.pop(t, None)
            self.eval_results.pop(t, None)

    # ---------------------------------------------------------------- status

    def set_version(self, version: int) -> None:
        with self.lock:
            if version < self.current_version:
                raise ValueError(f"version {version} is older than the current {self.current_version}")
            self.current_version = version

    def snapshot(self) -> dict:
        with self.lock:
            now = self.clock()
            samplers = [{
                "session_id": s.id, "name": s.name, "group": s.group, "recipe": dict(s.recipe),
                "accelerator": s.accelerator, "device": dict(s.device), "capacity": s.capacity,
                "accepted": s.accepted,
                "duplicates": s.duplicates, "rejected": s.rejected, "rejections": dict(s.rejections),
                "outstanding": s.outstanding, "weights_version": s.weights_version,
                "weight_failures": s.weight_failures, "active_samples": s.active_samples,
                "revoked": s.revoked, "revoked_reason": s.revoked_reason,
                "returned": dict(s.returned), "unrunnable_envs": sorted(s.unrunnable_envs),
                "last_seen_s_ago": now - s.last_seen, "probe": dataclasses.asdict(s.probe),
            } for s in self.sessions.values()]
            return {
                "current_version": self.current_version, "pending_samples": self.pending_samples,
                "pending_eval_items": len(self.eval_pending),
                "outstanding_samples": self.outstanding, "live_leases": len(self.leases),
                "open_tasks": len(self.tasks), "exhausted": self.exhausted and not self.pending,
                "totals": dict(self.totals), "groups": self.router.snapshot(), "samplers": samplers,
            }
