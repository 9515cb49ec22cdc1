"""The version probe where users look: per-step metrics, the status line, ``summary.json``.

Per group (``metrics.jsonl``, TensorBoard / W&B, ``plots/probe_kl.png``):

- ``group/<name>/probe_kl``, ``group/<name>/probe_max_abs``: the worst probe KL / max |Δ log p|
  among the group's samplers on the newest version the group reported on
  (``group/<name>/probe_version``): the mismatch of the recipe as served, on tokens the trainer
  drew, beside the k3 measured on trained samples;
- ``group/<name>/verified_lag``: current version minus the oldest version its live samplers last
  verified (a sampler that never verified counts from -1): a group whose reloads fail or whose
  samplers do not report grows it every publish.

``probe/alarms_total``: reports above their recipe's bound so far (``trainer_jax.service.probes``).
"""

from __future__ import annotations

import math

from trainer_jax.service.probes import ProbeBook


def probe_metrics(status: dict, book: ProbeBook) -> dict[str, float]:
    """The probe's metrics of one step, from the service's ``status()`` and its probe book."""
    values: dict[str, float] = {}
    for group, (version, kl, max_abs) in book.group_summary().items():
        values[f"group/{group}/probe_kl"] = kl
        values[f"group/{group}/probe_max_abs"] = max_abs
        values[f"group/{group}/probe_version"] = float(version)
    current = int(status["current_version"])
    oldest: dict[str, int] = {}
    for s in status["samplers"]:
        if s["revoked"]:
            continue
        v = int(s["probe"]["verified_version"])
        oldest[s["group"]] = min(oldest.get(s["group"], v), v)
    for group, v in oldest.items():
        values[f"group/{group}/verified_lag"] = float(current - v)
    values["probe/alarms_total"] = float(len(book.alarms))
    return values


#: a group whose samplers last verified this many versions ago or more raises an alarm (a
#: fully asynchronous sampler skips versions and verifies a few behind as a matter of course)
LAG_ALARM = 10


def lag_alarms(values: dict[str, float]) -> list[str]:
    """Groups unverified for ``LAG_ALARM`` versions or more (reloads refused or doing nothing,
    or samplers that do not report), as ``CollapseAlarms`` alarms (keyed by the text before the
    colon, so each group's alarm prints when raised and when cleared)."""
    return [f"group {k.split('/')[1]} unverified: its samplers last verified {v:.0f} versions "
            "ago (reloads refused or no-op, or no probe reports)"
            for k, v in sorted(values.items()) if k.endswith("/verified_lag") and v >= LAG_ALARM]


def probe_line(values: dict[str, float]) -> str:
    """`` probe kl max 1.2e-04`` for the status line (empty before any report)."""
    kls = [v for k, v in values.items() if k.endswith("/probe_kl") and math.isfinite(v)]
    if not kls:
        return ""
    lag = max((v for k, v in values.items() if k.endswith("/verified_lag")), default=0.0)
    return f" probe kl {max(kls):.1e}" + (f" unverified lag {lag:.0f}" if lag > 1 else "")


def probe_summary(status: dict, book: ProbeBook) -> dict:
    """``summary.json``'s ``"probe"``: per group and version the worst KL / max |Δ|, each
    sampler's last verdict and verified version, and the alarms raised."""
    by_group: dict[str, dict[str, dict[str, float]]] = {}
    with book.lock:
        for (version, group), (kl, max_abs) in sorted(book.by_group.items()):
            by_group.setdefault(group, {})[str(version)] = {"kl": kl, "max_abs": max_abs}
    samplers = [{"name": s["name"], "group": s["group"], "revoked": s["revoked"],
                 "revoked_reason": s.get("revoked_reason", ""),
                 "verified_version": s["probe"]["verified_version"],
                 "last_version": s["probe"]["version"], "verdict": s["probe"]["verdict"],
                 "kl": s["probe"]["kl"], "max_abs": s["probe"]["max_abs"]}
                for s in status["samplers"]]
    return {"groups": by_group, "samplers": samplers, "alarms": list(book.alarms)}


__all__ = ["LAG_ALARM", "lag_alarms", "probe_line", "probe_metrics", "probe_summary"]
