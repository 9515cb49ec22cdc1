"""The fleet's controller: a detached Ray actor that keeps every group at its replica target.

Named ``--name`` in the ``mixrl`` namespace, it owns the replica actors (``fleet.replica``), so
they share its fate: a controller that is killed takes its replicas (and their samplers) with it.
A supervision thread polls every replica each ``tick_s``: a replica whose actor died (killed, its
worker crashed, its node lost) or whose sampler exited is killed for good and replaced by a new
actor placed wherever the group's resources are free (after a back-off that doubles with each
death within ``healthy_s`` of a start, up to 60 s); a replica Ray cannot place yet stays
``starting``. Extra replicas (a lowered target) are stopped newest first, in order (SIGTERM to
the sampler, which returns its leases). With autoscale, every ``autoscale_every_s`` it reads the
trainer's ``Status`` and moves one replica between groups (``fleet.autoscale.decide``).

State is in this actor only: ``mixrl-fleet up`` on a running controller applies new targets
(``apply``), ``status`` reads ``status()``, ``down`` calls ``shutdown()`` and then kills it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping

from fleet.autoscale import GroupSignal, decide, read_status, smooth
from fleet.spec import GroupSpec

log = logging.getLogger("mixrl.fleet")
NAMESPACE = "mixrl"


@dataclasses.dataclass
class _Slot:
    name: str
    group: str
    actor: object
    created: float
    ref: object = None           # a pending state() call
    state: dict | None = None    # the last answer
    dead: str | None = None      # why, once dead
    stopping: object = None      # a pending stop() call
    stop_asked: float = 0.0


class Controller:
    """Keeps ``targets`` replicas per group running; see the module docstring."""

    def __init__(self, fleet: str, trainer: str, token: str, groups: list[dict], *,
                 plan: Mapping[str, int] | None = None, autoscale: bool = False, transfer: str = "auto",
                 python: str = "", tick_s: float = 1.0, autoscale_every_s: float = 60.0,
                 healthy_s: float = 60.0, supervise: bool = True):
        self.fleet, self.trainer, self._token = fleet, trainer, token
        self.transfer, self.python = transfer, python
        self.tick_s, self.autoscale_every_s, self.healthy_s = tick_s, autoscale_every_s, healthy_s
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self.slots: dict[str, _Slot] = {}
        self.events: list[str] = []
        self.replaced = 0
        self._index: dict[str, int] = {}
        self._backoff: dict[str, tuple[int, float]] = {}  # group -> (quick deaths, not before)
        self._signals: dict[str, dict[str, float | None]] = {}
        self._apply(groups, plan, autoscale)
        # supervise=False (tests): no supervision thread; ticks are called by hand
        self._thread = threading.Thread(target=self._loop, name="mixrl-fleet-controller", daemon=True)
        if supervise:
            self._thread.start()

    # ------------------------------------------------------------------ remote methods

    def apply(self, groups: list[dict], plan: Mapping[str, int] | None = None,
              autoscale: bool | None = None) -> dict:
        """New group specs and targets (``mixrl-fleet up`` on a running fleet); the new status."""
        self._apply(groups, plan, autoscale)
        return self.status()

    def status(self) -> dict:
        """Targets, replicas and their states, events: plain data for ``mixrl-fleet status``."""
        with self._lock:
            groups = []
            for name, spec in self.specs.items():
                states = [self._state_of(s) for s in self.slots.values() if s.group == name]
                groups.append({
                    "name": name, "accelerator": spec.accelerator, "target": self.targets[name],
                    "plan": (self.plan or {}).get(name), "min": spec.min_replicas, "max": spec.max_replicas,
                    "ray_options": spec.ray_options(), "price_per_hour": spec.price_per_hour,
                    **{k: sum(st == k for st in states) for k in ("running", "starting", "dead")},
                    "signals": self._signals.get(name, {})})
            replicas = [{**(s.state or {}), "name": s.name, "group": s.group, "state": self._state_of(s),
                         "detail": self._detail_of(s)} for s in self.slots.values()]
            return {"fleet": self.fleet, "trainer": self.trainer, "autoscale": self.autoscale,
                    "groups": groups, "replicas": replicas, "replaced": self.replaced,
                    "events": self.events[-20:]}

    def shutdown(self, grace_s: float = 20.0) -> dict:
        """Stop supervising, stop every replica in order and kill its actor; what was stopped."""
        import ray

        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        with self._lock:
            slots = list(self.slots.values())
            self.slots.clear()
        refs = {}
        for s in slots:
            try:
                refs[s.name] = s.actor.stop.remote(grace_s)
            except Exception:  # noqa: BLE001 - a dead actor: nothing to stop
                pass
        codes = {}
        for name, ref in refs.items():
            try:
                codes[name] = ray.get(ref, timeout=grace_s + 10)
            except Exception as e:  # noqa: BLE001 - a dead or stuck replica is killed below
                codes[name] = f"{type(e).__name__}"
        for s in slots:
            ray.kill(s.actor, no_restart=True)
        return {"stopped": sorted(s.name for s in slots), "exit_codes": codes}

    def ping(self) -> str:
        return self.fleet

    # ------------------------------------------------------------------ internals

    def _apply(self, groups: list[dict], plan: Mapping[str, int] | None, autoscale: bool | None) -> None:
        specs = {g["name"]: GroupSpec(**{**g, "sampler_args": tuple(g["sampler_args"])}) for g in groups}
        with self._lock:
            self.specs = specs
            self.targets = {n: s.replicas for n, s in specs.items()}
            self.plan = dict(plan) if plan else None
            if autoscale is not None:
                self.autoscale = autoscale
            self._event(f"targets {self.targets}" + (" (autoscale)" if self.autoscale else ""))

    def _event(self, text: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {text}"
        log.info("%s", line)
        self.events.append(line)
        del self.events[:-200]

    @staticmethod
    def _state_of(s: _Slot) -> str:
        if s.dead or s.stopping is not None:
            return "dead"
        return (s.state or {}).get("state", "starting")

    @staticmethod
    def _detail_of(s: _Slot) -> str:
        if s.dead:
            return s.dead
        if s.stopping is not None:
            return "stopping"
        return (s.state or {}).get("detail", "waiting for placement")

    def _loop(self) -> None:
        last_scale = time.monotonic()
        while not self._stop.wait(self.tick_s):
            try:
                self._poll()
                self._reconcile()
                if self.autoscale and time.monotonic() - last_scale >= self.autoscale_every_s:
                    last_scale = time.monotonic()
                    self._autoscale()
            except Exception:  # noqa: BLE001 - the supervisor must outlive one bad tick
                log.exception("fleet controller tick failed")

    def _poll(self) -> None:
        import ray
        from ray.exceptions import RayActorError

        with self._lock:
            slots = list(self.slots.values())
        for s in slots:
            if s.dead:
                continue
            if s.ref is None:
                s.ref = s.actor.state.remote()
            ready, _ = ray.wait([s.ref], timeout=0)
            if not ready:
                continue
            try:
                s.state = ray.get(s.ref)
                if s.state["state"] == "dead":
                    s.dead = s.state["detail"]
            except RayActorError as e:
                s.dead = "the actor died: " + (str(e).strip().splitlines() or ["?"])[0][:200]
            s.ref = None

    def _reconcile(self) -> None:
        import ray

        now = time.monotonic()
        with self._lock:
            for s in [s for s in self.slots.values() if s.dead and s.stopping is None]:
                ray.kill(s.actor, no_restart=True)  # its sampler goes with the worker
                del self.slots[s.name]
                self.replaced += 1
                quick, _ = self._backoff.get(s.group, (0, 0.0))
                quick = quick + 1 if now - s.created < self.healthy_s else 0
                delay = min(2.0 ** quick, 60.0) if quick else 0.0
                self._backoff[s.group] = (quick, now + delay)
                self._event(f"replica {s.name} dead ({s.dead}); replacing"
                            + (f" in {delay:.0f} s" if delay else ""))
            for s in [s for s in self.slots.values() if s.stopping is not None]:
                done, _ = ray.wait([s.stopping], timeout=0)
                if done or now - s.stop_asked > 60:
                    ray.kill(s.actor, no_restart=True)
                    del self.slots[s.name]
            for name, spec in self.specs.items():
                live = sorted((s for s in self.slots.values()
                               if s.group == name and s.stopping is None and not s.dead),
                              key=lambda s: s.created)
                target = self.targets[name]
                for s in live[target:][::-1]:
                    s.stopping, s.stop_asked = s.actor.stop.remote(), now
                    self._event(f"stopping {s.name} (target {target})")
                _, not_before = self._backoff.get(name, (0, 0.0))
                for _ in range(target - len(live)):
                    if now < not_before:
                        break
                    self._start(spec, now)
            for name in [n for n in {s.group for s in self.slots.values()} if n not in self.specs]:
                for s in self.slots.values():
                    if s.group == name and s.stopping is None:
                        s.stopping, s.stop_asked = s.actor.stop.remote(), now

    def _start(self, spec: GroupSpec, now: float) -> None:
        import ray

        from fleet.replica import Replica

        i = self._index.get(spec.name, 0)
        self._index[spec.name] = i + 1
        name = f"{spec.name}-{i}"
        actor = ray.remote(Replica).options(max_concurrency=4, max_restarts=0, **spec.ray_options()).remote(
            name, spec.name, self.trainer, self._token, spec.sampler_args, python=self.python,
            transfer=self.transfer, fleet=self.fleet)
        actor.start.remote()
        self.slots[name] = _Slot(name, spec.name, actor, now)
        self._event(f"starting {name} ({spec.ray_options()})")

    def _autoscale(self) -> None:
        from sampler_torch.client import Backoff, RolloutClient, RolloutError

        client = RolloutClient(self.trainer, self._token, group="mixrl-fleet", max_retry_s=5.0,
                               rpc_timeout_s=5.0, backoff=Backoff(initial_s=0.5, max_s=2.0))
        try:
            st = client.status()
        except (RolloutError, Exception) as e:  # noqa: BLE001 - a trainer away: no move this time
            self._event(f"autoscale: no Status from {self.trainer} ({type(e).__name__})")
            return
        finally:
            client.close()
        with self._lock:
            read = read_status(st, {n: s.capacity for n, s in self.specs.items()})
            for name, values in read.items():
                old = self._signals.setdefault(name, {})
                for k, v in values.items():
                    old[k] = smooth(old.get(k), v)
            sig = [GroupSignal(n, self.targets[n], s.min_replicas, s.max_replicas, s.price_per_hour,
                               **self._signals.get(n, {})) for n, s in self.specs.items()]
            move = decide(sig)
            if move is not None:
                self.targets[move.donor] -= 1
                self.targets[move.receiver] += 1
                self._event(f"autoscale: one replica {move.donor} -> {move.receiver}: {move.why}")


def group_dicts(specs: list[GroupSpec]) -> list[dict]:
    """``GroupSpec``s as plain data for the controller's arguments."""
    return [dataclasses.asdict(s) for s in specs]
