"""The fleet controller's behaviour its cosmic-ray mutants showed untested (issue 46;
docs/testing.md): a lowered target stops every extra replica, newest first, in one tick; status
counts a group's replicas after ``apply`` (new group specs, as a remote call delivers them); the
supervision loop autoscales every ``autoscale_every_s`` on its clock.

As in ``test_controller_backoff.py``: the controller's own methods run on a fake clock
(``fleet.controller.time``) without a Ray cluster; ``_start`` records a replica instead of placing
an actor, and a replica's ``stop.remote()`` returns a token.
"""

from __future__ import annotations

import json
import threading
import time
import types

import ray

import fleet.controller as controller_mod
from fleet.controller import Controller, _Slot

GROUP = {"name": "pool-a", "replicas": 3, "min_replicas": 0, "max_replicas": 4, "accelerator": None,
         "price_per_hour": None, "resources": {}, "capacity": 4, "weight_format": "bf16",
         "sampler_args": []}


class _Actor:
    def __init__(self):
        self.stops = 0

        def remote(*args):
            self.stops += 1
            return f"stop-{id(self)}"

        self.stop = types.SimpleNamespace(remote=remote)


def _controller(monkeypatch, clock: dict, groups: list[dict], **kw) -> Controller:
    monkeypatch.setattr(controller_mod, "time", types.SimpleNamespace(
        monotonic=lambda: clock["now"], strftime=time.strftime))
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: None)
    ctrl = Controller("f", "127.0.0.1:1", "tok", groups, supervise=False, **kw)

    def start(spec, now):
        name = f"{spec.name}-{len(ctrl.slots)}"
        ctrl.slots[name] = _Slot(name, spec.name, _Actor(), now)

    ctrl._start = start
    return ctrl


def test_a_lowered_target_stops_every_extra_replica_newest_first_in_one_tick(monkeypatch):
    clock = {"now": 1000.0}
    ctrl = _controller(monkeypatch, clock, [dict(GROUP, replicas=4)])
    ctrl._reconcile()
    assert sorted(ctrl.slots) == ["pool-a-0", "pool-a-1", "pool-a-2", "pool-a-3"]
    for i, name in enumerate(sorted(ctrl.slots)):
        ctrl.slots[name].created = 1000.0 + i  # pool-a-3 the newest
    ctrl.apply([dict(GROUP, replicas=1)])
    clock["now"] = 1010.0
    ctrl._reconcile()
    stopping = {n for n, s in ctrl.slots.items() if s.stopping is not None}
    assert stopping == {"pool-a-1", "pool-a-2", "pool-a-3"}
    assert all(ctrl.slots[n].stop_asked == 1010.0 and ctrl.slots[n].actor.stops == 1 for n in stopping)
    assert [e.split(" ", 1)[1] for e in ctrl.events[-3:]] == [
        "stopping pool-a-3 (target 1)", "stopping pool-a-2 (target 1)", "stopping pool-a-1 (target 1)"]


def test_status_counts_a_groups_replicas_after_new_specs_are_applied(monkeypatch):
    clock = {"now": 1000.0}
    ctrl = _controller(monkeypatch, clock, [dict(GROUP, replicas=2)])
    ctrl._reconcile()
    ctrl._reconcile()
    for s in ctrl.slots.values():
        s.state = {"state": "running"}
    # `mixrl-fleet up` on a running fleet: the specs arrive anew (equal names, new objects)
    ctrl.apply(json.loads(json.dumps([dict(GROUP, replicas=2)])))
    (group,) = ctrl.status()["groups"]
    assert (group["name"], group["running"], group["starting"], group["dead"]) == ("pool-a", 2, 0, 0)


def test_the_supervision_loop_autoscales_every_autoscale_every_s(monkeypatch):
    clock = {"now": 1000.0}
    ctrl = _controller(monkeypatch, clock, [dict(GROUP, replicas=0)], autoscale=True,
                       autoscale_every_s=30.0, tick_s=0.002)
    calls: list[float] = []
    ctrl._autoscale = lambda: calls.append(clock["now"])  # reads the trainer's Status over gRPC

    def wait_for(n: int, limit: float) -> bool:
        end = time.monotonic() + limit
        while len(calls) < n and time.monotonic() < end:
            time.sleep(0.01)
        return len(calls) >= n

    loop = threading.Thread(target=ctrl._loop, daemon=True)
    loop.start()
    try:
        time.sleep(0.1)  # the loop has read its start (1000) and ticks
        clock["now"] = 1029.9
        assert not wait_for(1, 0.3), calls
        clock["now"] = 1030.0
        assert wait_for(1, 10.0), "no autoscale 30 s after the start"
        clock["now"] = 1059.0
        assert not wait_for(2, 0.3), calls
        clock["now"] = 1060.0
        assert wait_for(2, 10.0), "no autoscale 30 s after the last"
        assert calls == [1030.0, 1060.0]
    finally:
        ctrl._stop.set()
        loop.join(10)
