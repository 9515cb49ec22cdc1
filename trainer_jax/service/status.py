"""The rollout service's state as users see it: the wire's ``StatusResponse`` and the one-line
summaries ``mixrl-train serve`` prints."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Protocol

from mixrl_wire import pb
from trainer_jax.service.probes import ProbeBook


class ServiceState(Protocol):
    """What these summaries read of a running service (``server.RolloutService`` is one): a
    protocol, so that this module does not import the server that imports it."""

    server_id: str
    probes: ProbeBook
    _stopping: threading.Event

    def status(self) -> dict: ...


def status_response(svc: ServiceState) -> pb.StatusResponse:
    """The service's ``status()`` as the wire's ``StatusResponse``."""
    st = svc.status()
    t = st["totals"]
    probed = svc.probes.group_summary()
    groups = []
    for name, g in st["groups"].items():
        version, kl, max_abs = probed.get(name, (-1, 0.0, 0.0))
        capacity = g.get("capacity") or 0
        groups.append(pb.GroupStatus(
            name=name, samplers=g["samplers"], tokens_per_s=g["tokens_per_s"], share=g["share"],
            outstanding=g["outstanding"], accepted=g["accepted"], probe_version=version,
            probe_kl=kl, probe_max_abs=max_abs, useful_share=g.get("useful_share"),
            idle_share=(max(0.0, 1.0 - g["outstanding"] / capacity) if g["samplers"] and capacity > 0
                        else None),
            samples_per_busy_s=g.get("samples_per_busy_s") or 0.0))
    samplers = [pb.SamplerStatus(
        session_id=s["session_id"], name=s["name"], group=s["group"], recipe=pb.Recipe(**s["recipe"]),
        accelerator=s["accelerator"], accepted=s["accepted"], duplicates=s["duplicates"],
        rejected=s["rejected"], rejections=s["rejections"], outstanding=s["outstanding"],
        weights_version=s["weights_version"], weight_failures=s["weight_failures"],
        last_seen_s_ago=s["last_seen_s_ago"],
        device=pb.ComputeDevice(**s["device"]) if s.get("device") else None,
        verified_version=s["probe"]["verified_version"], probe_version=s["probe"]["version"],
        probe_kl=s["probe"]["kl"], probe_max_abs=s["probe"]["max_abs"],
        probe_verdict=s["probe"]["verdict"], probe_reason=s["probe"]["reason"],
        returned=s["returned"])
        for s in st["samplers"]]
    return pb.StatusResponse(
        server_id=svc.server_id, current_version=st["current_version"], uptime_s=st["uptime_s"],
        pending_samples=st["pending_samples"], outstanding_samples=st["outstanding_samples"],
        buffered_trajectories=st["buffer"]["held_trajectories"],
        buffered_bytes=st["buffer"]["held_bytes"], ready_groups=st["buffer"]["ready_groups"],
        accepted=t.get("accepted", 0), duplicates=t.get("duplicates", 0), rejected=t.get("rejected", 0),
        taken_groups=st["buffer"]["taken_groups"], requeued_samples=t.get("requeued_samples", 0),
        groups=groups, samplers=samplers)


def watch_status_lines(service: ServiceState, every_s: float) -> Iterator[str]:
    """One-line summaries of the service's state every ``every_s`` seconds (for ``serve``)."""
    while not service._stopping.wait(every_s):
        st = service.status()
        t = st["totals"]
        shares = " ".join(f"{g}={v['share']:.2f}@{v['tokens_per_s']:.0f}tok/s"
                          for g, v in st["groups"].items())
        # what the samplers compute on, as they registered: e.g. cuda=2,cpu=1 (?: unreported)
        kinds: dict[str, int] = {}
        for s in st["samplers"]:
            kind = (s.get("device") or {}).get("type") or "?"
            kinds[kind] = kinds.get(kind, 0) + 1
        devices = ",".join(f"{k}={n}" for k, n in sorted(kinds.items())) or "-"
        # the version probe: samplers that verified the current version, of those live
        live = [s for s in st["samplers"] if not s["revoked"]]
        verified = sum(s["probe"]["verified_version"] >= st["current_version"] for s in live)
        yield (f"v{st['current_version']} samplers={len(st['samplers'])} devices={devices} "
               f"verified={verified}/{len(live)} "
               f"accepted={t.get('accepted', 0)} "
               f"dup={t.get('duplicates', 0)} rejected={t.get('rejected', 0)} "
               f"requeued={t.get('requeued_samples', 0)} dropped_groups={st['dropped_groups']} "
               f"pending={st['pending_samples']} leased={st['outstanding_samples']} [{shares}]")


__all__ = ["status_response", "watch_status_lines"]
