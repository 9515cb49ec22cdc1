"""Scheduler bookkeeping the scheduler's mutants showed untested (issue 37; docs/testing.md).

The service's own scheduler (``RolloutService.from_config``, not started: no server, no reaper
thread), driven through its methods with its injectable clock."""

from __future__ import annotations

import pytest

from mixrl_wire import pb
from trainer_jax.config import load_config
from trainer_jax.service import RolloutService
from trainer_jax.service.sessions import Rejected


def _scheduler(*overrides: str):
    cfg = load_config(None, ["service.listen=127.0.0.1:0", "tasks.group_size=2",
                             "tasks.sampling.max_new_tokens=8", *overrides])
    sched = RolloutService.from_config(cfg, token="t").scheduler
    now = [1000.0]
    sched.clock = lambda: now[0]
    sched.now = now
    return sched


@pytest.fixture
def scheduler():
    return _scheduler()


def test_an_expired_session_leaves_its_groups_sampler_and_capacity_counts(scheduler):
    ttl = scheduler.cfg.session_ttl_s
    a = scheduler.register(pb.RegisterRequest(group="bf16", capacity=4, name="a"), "peer-a")
    b = scheduler.register(pb.RegisterRequest(group="bf16", capacity=2, name="b"), "peer-b")
    scheduler.register(pb.RegisterRequest(group="fp8", capacity=3, name="c"), "peer-c")
    group = lambda name: {k: scheduler.snapshot()["groups"][name][k] for k in ("samplers", "capacity")}
    assert group("bf16") == {"samplers": 2, "capacity": 6} and group("fp8") == {"samplers": 1, "capacity": 3}
    scheduler.now[0] += ttl * 0.75
    scheduler.touch(b.id)
    scheduler.now[0] += ttl * 0.5  # a and c silent for 1.25 ttl, b for 0.5
    scheduler.expire()
    assert group("bf16") == {"samplers": 1, "capacity": 2} and group("fp8") == {"samplers": 0, "capacity": 0}
    assert set(scheduler.sessions) == {b.id} and a.id not in scheduler.sessions
    assert scheduler.totals["sessions_expired"] == 2


def test_the_version_only_moves_forward(scheduler):
    scheduler.set_version(3)
    scheduler.set_version(3)  # the same version again (a republish) is fine
    with pytest.raises(ValueError, match="version 2 is older than the current 3"):
        scheduler.set_version(2)
    assert scheduler.snapshot()["current_version"] == 3


def test_a_session_can_return_only_its_own_leases(scheduler):
    # Both directions: session ids are random, so one of the two has the larger id whichever way
    # a wrong comparison leans.
    a = scheduler.register(pb.RegisterRequest(group="bf16", capacity=2, name="a"), "peer-a")
    b = scheduler.register(pb.RegisterRequest(group="bf16", capacity=2, name="b"), "peer-b")
    (ta,) = scheduler.lease(pb.LeaseRequest(session_id=a.id, max_samples=2)).tasks
    (tb,) = scheduler.lease(pb.LeaseRequest(session_id=b.id, max_samples=2)).tasks
    for who, lease in ((b, ta), (a, tb)):
        with pytest.raises(Rejected, match="not a live lease of this session") as refused:
            scheduler.return_lease(pb.ReturnLeaseRequest(session_id=who.id, lease_id=lease.lease_id))
        assert refused.value.field == "lease_id"
    assert set(scheduler.leases) == {ta.lease_id, tb.lease_id}
    pending = scheduler.pending_samples
    scheduler.return_lease(pb.ReturnLeaseRequest(session_id=a.id, lease_id=ta.lease_id, reason="busy"))
    assert set(scheduler.leases) == {tb.lease_id} and scheduler.pending_samples == pending + 2
    assert dict(a.returned) == {"busy": 2}


def test_a_refused_lease_names_why_with_one_slot_of_the_buffer_left():
    # 3 trajectories of room, 2 leased: one slot is free, so the buffer is not what stops the
    # session asking again; its own outstanding limit (capacity 2) is.
    sched = _scheduler("service.buffer.max_trajectories=3")
    s = sched.register(pb.RegisterRequest(group="bf16", capacity=2, name="a"), "peer-a")
    assert len(sched.lease(pb.LeaseRequest(session_id=s.id, max_samples=2)).tasks) == 1
    again = sched.lease(pb.LeaseRequest(session_id=s.id, max_samples=2))
    assert not again.tasks and again.reason == "session at its outstanding limit", again


def test_totals_count_sessions_and_requeued_evaluation_samples_and_a_task_carries_its_deadline():
    """The status totals an operator reads: every registration (``sessions``) and the evaluation
    samples an overdue lease put back (``requeued_eval_samples``, apart from training's). A leased
    task tells the sampler its lease's deadline in Unix milliseconds (now + ``lease_ttl_s``)."""
    import dataclasses
    import time

    cfg = load_config(None, ["service.listen=127.0.0.1:0", "tasks.group_size=2",
                             "tasks.sampling.max_new_tokens=8"])
    svc = RolloutService.from_config(cfg, token="t")
    sched, now = svc.scheduler, [1000.0]
    sched.clock = lambda: now[0]
    a = sched.register(pb.RegisterRequest(group="bf16", capacity=4, name="a"), "peer-a")
    sched.register(pb.RegisterRequest(group="fp8", capacity=4, name="b"), "peer-b")
    assert sched.snapshot()["totals"]["sessions"] == 2
    (task_id,) = sched.add_evaluation([dataclasses.replace(svc.source.spec(1000, group_size=3),
                                                           evaluation=True, group="bf16")])
    sched.heartbeat(pb.HeartbeatRequest(session_id=a.id, weights_version=0))  # has loaded version 0
    ttl = sched.cfg.lease_ttl_s
    t0 = time.time()
    (task,) = sched.lease(pb.LeaseRequest(session_id=a.id, max_samples=3)).tasks
    t1 = time.time()
    assert task.task_id == task_id and list(task.sample_indices) == [0, 1, 2]
    assert int((t0 + ttl) * 1000) <= task.deadline_unix_ms <= int((t1 + ttl) * 1000), task.deadline_unix_ms
    now[0] += ttl + 1
    sched.touch(a.id)  # the session lives on; its lease is overdue
    sched.expire()
    assert a.id in sched.sessions and task.lease_id not in sched.leases
    assert sched.totals["requeued_eval_samples"] == 3 and sched.totals["requeued_samples"] == 0
    assert sched.snapshot()["totals"]["sessions"] == 2
