"""The fleet controller's replacement back-off on a fake clock (issue 46), against a reference of
the documented rule: a replica that dies within ``healthy_s`` of its start counts a quick death
and its group waits 2^quick s (at most 60 s) before the replacement; one that lived longer resets
the count and is replaced at once.

The controller's own ``_reconcile`` runs, with its clock (``fleet.controller.time``) replaced by
a fake one and no Ray cluster: ``ray.kill`` is a no-op here and ``_start`` records the start
instead of placing an actor (both need a cluster; ``tests/fleet/test_ray_fleet.py`` runs them).
"""

from __future__ import annotations

import time
import types

import hypothesis.strategies as st
import pytest
import ray
from hypothesis import given, settings

import fleet.controller as controller_mod
from fleet.controller import Controller, _Slot

GROUP = {"name": "g", "replicas": 1, "min_replicas": 0, "max_replicas": 2, "accelerator": None,
         "price_per_hour": None, "resources": {}, "capacity": 4, "weight_format": "bf16", "sampler_args": []}


class Fleet:
    """A controller on a fake clock whose replicas are records."""

    def __init__(self, monkeypatch, healthy_s: float = 60.0):
        self.now = 1000.0
        monkeypatch.setattr(controller_mod, "time", types.SimpleNamespace(
            monotonic=lambda: self.now, strftime=time.strftime))
        monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: None)
        self.ctrl = Controller("f", "127.0.0.1:1", "tok", [GROUP], healthy_s=healthy_s, supervise=False)
        self.starts: list[float] = []

        def start(spec, now):
            name = f"{spec.name}-{len(self.starts)}"
            self.starts.append(now)
            self.ctrl.slots[name] = _Slot(name, spec.name, object(), now)

        self.ctrl._start = start

    def tick(self, at: float) -> bool:
        """Reconcile at ``at``; whether a replica was started."""
        self.now, n = at, len(self.starts)
        self.ctrl._reconcile()
        return len(self.starts) > n

    def kill(self) -> None:
        (slot,) = self.ctrl.slots.values()
        slot.dead = "the actor died: test"


def reference_delays(lifetimes: list[float], healthy_s: float) -> list[float]:
    """The wait before each replacement, by the documented rule."""
    quick, out = 0, []
    for life in lifetimes:
        quick = quick + 1 if life < healthy_s else 0
        out.append(min(2.0 ** quick, 60.0) if quick else 0.0)
    return out


def _replay(fleet: Fleet, lifetimes: list[float]) -> list[float]:
    """Kill the replica after each lifetime and measure, on the fake clock, how long the
    controller waits before starting its replacement: the first of the waits the rule can give
    at which it starts, having not started a millisecond before (a tick that starts nothing
    changes nothing)."""
    if not fleet.ctrl.slots:
        assert fleet.tick(fleet.now)  # the first replica
    waits = []
    for life in lifetimes:
        died = fleet.now + life
        fleet.tick(died)  # nothing to do while it lives
        fleet.kill()
        for w in (0.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 64.0):
            if w:
                assert not fleet.tick(died + w - 1e-3), (life, w)
            if fleet.tick(died + w):
                waits.append(w)
                break
        else:
            pytest.fail(f"no replacement within 64 s of a death after {life} s")
    return waits


def test_a_long_lived_replica_is_replaced_at_once_after_quick_deaths(monkeypatch):
    """Issue 46: three quick deaths (waits of 2, 4, 8 s), then a replica that ran for 100 s: its
    replacement starts at once. A count never reset made it wait 16 s, and up to 60."""
    fleet = Fleet(monkeypatch)
    assert _replay(fleet, [5.0, 3.0, 1.0, 100.0, 2.0]) == [2.0, 4.0, 8.0, 0.0, 2.0]
    assert fleet.ctrl.replaced == 5
    assert any("replacing in 8 s" in e for e in fleet.ctrl.events)


def test_the_wait_ends_exactly_at_its_time_and_is_capped_at_60_s(monkeypatch):
    fleet = Fleet(monkeypatch, healthy_s=60.0)
    assert fleet.tick(fleet.now)
    died = fleet.now + 59.5  # inside healthy_s: a quick death (binary fractions: exact sums)
    fleet.now = died
    fleet.kill()
    assert not fleet.tick(died)
    assert not fleet.tick(died + 1.999)
    assert fleet.tick(died + 2.0)  # not before 2 s, and exactly then
    # exactly healthy_s: not quick (lived < healthy_s is quick), replaced at once
    fleet.now += 60.0
    fleet.kill()
    assert fleet.tick(fleet.now)
    assert _replay(fleet, [1.0] * 7)[-2:] == [60.0, 60.0]  # 2^6 = 64: capped


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from([0.5, 10.0, 59.0, 60.0, 61.0, 300.0]), min_size=1, max_size=8),
       st.sampled_from([30.0, 60.0]))
def test_waits_are_the_reference_on_generated_lifetimes(lifetimes, healthy_s):
    with pytest.MonkeyPatch.context() as mp:
        fleet = Fleet(mp, healthy_s=healthy_s)
        want = reference_delays(lifetimes, healthy_s)
        got = _replay(fleet, lifetimes)
    assert got == want, (lifetimes, got, want)


def test_a_replica_told_to_stop_gets_60_s_before_it_is_killed(monkeypatch):
    """A lowered target stops the newest replica in order (its sampler returns its leases) and
    kills it only when it has stopped or 60 s after asking. Measured from the wrong time (``now``
    for ``now - stop_asked``) it was killed at once (mutate_human, controller.py)."""
    fleet = Fleet(monkeypatch)
    killed = []
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: killed.append(actor))
    monkeypatch.setattr(ray, "wait", lambda refs, timeout=0: ([], refs))  # never stops by itself

    class Actor:
        stop = types.SimpleNamespace(remote=lambda *a: "stop-ref")

    def start(spec, now):
        name = f"{spec.name}-{len(fleet.starts)}"
        fleet.starts.append(now)
        fleet.ctrl.slots[name] = _Slot(name, spec.name, Actor(), now)

    fleet.ctrl._start = start
    assert fleet.tick(fleet.now)
    fleet.ctrl.targets["g"] = 0
    asked = fleet.now + 5.0
    fleet.tick(asked)
    assert fleet.ctrl.slots["g-0"].stopping == "stop-ref" and killed == []
    fleet.tick(asked + 60.0)  # exactly 60 s: still waiting
    assert "g-0" in fleet.ctrl.slots and killed == []
    fleet.tick(asked + 60.5)
    assert "g-0" not in fleet.ctrl.slots and len(killed) == 1


def test_each_replacement_is_a_new_actor_under_a_new_name(monkeypatch):
    """The controller's own ``_start`` with Ray's actor factory recorded (no cluster here): every
    replica gets the next index of its group (a replacement reusing a name would overwrite the
    slot of a live one), never restarted by Ray (the controller replaces it), 4 calls at once."""
    fleet = Fleet(monkeypatch)
    fleet.ctrl._start = Controller._start.__get__(fleet.ctrl)
    made = []

    class Factory:
        def options(self, **kw):
            made.append(kw)
            return self

        def remote(self, name, group, trainer, token, args, **kw):
            assert (group, trainer, token, kw) == ("g", "127.0.0.1:1", "tok",
                                                   {"python": "", "transfer": "auto", "fleet": "f"})
            return types.SimpleNamespace(name=name, start=types.SimpleNamespace(remote=lambda: None))

    monkeypatch.setattr(ray, "remote", lambda cls: Factory())
    fleet.ctrl.targets["g"] = 2
    fleet.ctrl._reconcile()
    assert sorted(fleet.ctrl.slots) == ["g-0", "g-1"]
    fleet.ctrl.slots["g-0"].dead = "the actor died: test"
    fleet.now += 300.0  # a long-lived replica: replaced at once
    fleet.ctrl._reconcile()
    assert sorted(fleet.ctrl.slots) == ["g-1", "g-2"] and fleet.ctrl.slots["g-2"].actor.name == "g-2"
    assert all(kw["max_restarts"] == 0 and kw["max_concurrency"] == 4 for kw in made) and len(made) == 3


def test_a_dead_actors_reason_is_one_line_of_at_most_200_characters_and_events_say_autoscale(monkeypatch):
    from ray.exceptions import RayActorError

    class Died(RayActorError):
        def __str__(self) -> str:
            return "x" * 300 + "\nsecond line"

    fleet = Fleet(monkeypatch)
    assert fleet.tick(fleet.now)
    monkeypatch.setattr(ray, "wait", lambda refs, timeout=0: (refs, []))
    monkeypatch.setattr(ray, "get", lambda ref: (_ for _ in ()).throw(Died()))
    fleet.ctrl.slots["g-0"].actor = types.SimpleNamespace(state=types.SimpleNamespace(remote=lambda: "ref"))
    fleet.ctrl._poll()
    assert fleet.ctrl.slots["g-0"].dead == "the actor died: " + "x" * 200
    auto = Controller("f", "127.0.0.1:1", "tok", [GROUP], autoscale=True, supervise=False)
    assert auto.events[-1].endswith("targets {'g': 1} (autoscale)")
    assert fleet.ctrl.events[0].endswith("targets {'g': 1}")
