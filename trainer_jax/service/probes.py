"""The rollout service's half of the version probe: keep each version's ``probe.json``, judge
what samplers report after a load (``ReportProbe``), and act.

A report is judged in this order (``mixrl_wire.probe``):

1. **The weights first.** A sampler whose load changed the export's files but not the fingerprint
   of what it serves (``weights_unchanged``; the engine hashes what it loaded, vLLM answers
   ``/weight_checker``) did a no-op reload: it is asked to reload (``RELOAD``) up to
   ``service.probe.max_reloads`` times, then revoked with the reason.
2. **Which version.** On the previous version's continuation, log q closer to p_{v-1} than to p_v,
   when the two versions differ by more than ``margin`` times the recipe's noise: ``older``, asked
   to reload (up to ``max_reloads``) and shown in ``Status``, never revoked on this alone (a
   quantized export can absorb a small update). Closer than that: ``undecided``.
3. **How far.** Probe KL or max |Δ log p| above the bound: an alarm (logged once when a sampler
   goes above for ``alarm_after`` reports in a row, counted, in ``Status``; one report of 64
   tokens swings widely). ``service.probe.bounds: run`` (default): a probe KL above
   ``alarm_factor`` x the median of the group's newest reports (``RECENT``, at least
   ``baseline_versions``), never below the measured table's bound: a jump, not the slow growth
   of the mismatch as the policy sharpens — a recipe's mismatch depends on the model
   (on the demo's trained policy, nvfp4_w4a4 shows a probe KL near 0.1 where the table's tiny
   random policies show 4e-4). ``bounds: table``: the measured bound (per recipe, backend and device
   kind: ``probe_bounds.json``, ``benchmarks/bench_probe.py``) as is; with
   ``service.probe.enforce`` the sampler is then revoked, but only where the bound was measured on
   its device kind (CPU-measured bounds alarm, never enforce, on a GPU).

A report that passes sets the sampler's ``verified_version``. Samplers that never report stay
``unverified`` (verified_version -1), which ``Status`` and the status line show.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import threading
from collections.abc import Mapping
from pathlib import Path

from mixrl_wire import pb
from mixrl_wire.probe import (
    ERROR,
    NOOP_RELOAD,
    OLDER,
    Bound,
    Probe,
    ProbeError,
    judge,
)
from trainer_jax.config.service import ProbeConfig
from trainer_jax.service.sessions import Session

log = logging.getLogger("mixrl.service")

BOUNDS_FILE = Path(__file__).with_name("probe_bounds.json")
#: reports per group that ``bounds: run`` takes its median over (the newest)
RECENT = 16
#: used for a recipe nothing was measured for: loose enough that only a broken sampler alarms
DEFAULT_BOUND = Bound(kl=0.05, max_abs=2.0, noise=1e-3)


def load_bounds(path: str | Path = BOUNDS_FILE) -> dict[str, Bound]:
    """``{"recipe/backend/device": Bound}`` from the measured table (see its ``measured``)."""
    data = json.loads(Path(path).read_text())
    return {key: Bound(float(b["kl"]), float(b["max_abs"]), float(b["noise"]),
                       str(b.get("measured_on", key.rsplit("/", 1)[-1])))
            for key, b in data["bounds"].items()}


def bound_for(bounds: Mapping[str, Bound], recipe: str, backend: str, device: str) -> Bound:
    """The bound of (recipe, backend, device kind): exact, else the same recipe and backend
    measured on another device, else the recipe on any backend, else ``DEFAULT_BOUND``. Only an
    exact match keeps ``measured_on`` equal to ``device`` (what enforcement requires)."""
    backend = {"mixrl-engine": "engine"}.get(backend, backend or "engine")
    exact = bounds.get(f"{recipe}/{backend}/{device}")
    if exact is not None:
        return exact
    for key in sorted(bounds):
        r, b, _ = key.split("/")
        if r == recipe and b == backend:
            return bounds[key]
    for key in sorted(bounds):
        if key.split("/")[0] == recipe:
            return bounds[key]
    return DEFAULT_BOUND


class ProbeBook:
    """Probes by version, and the judgement of each report against them."""

    def __init__(self, cfg: ProbeConfig, bounds: Mapping[str, Bound] | None = None, keep: int = 8):
        self.cfg = cfg
        self.bounds = dict(load_bounds() if bounds is None else bounds)
        self.keep = keep
        self.probes: dict[int, Probe] = {}
        self.lock = threading.Lock()
        #: (version, group) -> worst (kl, max_abs) reported by the group's samplers
        self.by_group: dict[tuple[int, str], tuple[float, float]] = {}
        #: group -> its first reports' (kl, max_abs), the baseline of ``bounds: run``
        self.baselines: dict[str, list[tuple[float, float]]] = {}
        self.alarms: list[str] = []  # one line each time a sampler goes above its bound

    def add(self, probe: Probe) -> None:
        with self.lock:
            self.probes[probe.version] = probe
            for old in sorted(self.probes)[:-self.keep]:
                del self.probes[old]

    def add_from_dir(self, version: int, directory: str | Path) -> None:
        """The probe written into a local export directory (``mixrl-train serve``), if any."""
        from mixrl_wire.probe import read_probe

        try:
            probe = read_probe(directory)
        except ProbeError as e:
            log.warning("version %d: %s (no probe for this version)", version, e)
            return
        if probe is not None:
            self.add(probe)

    def report(self, s: Session, req: pb.ProbeReport) -> tuple[int, str]:
        """Judge one report of session ``s`` (updating ``s.probe``); return ``(action, reason)``
        with ``action`` a ``pb.ProbeAck.Action``."""
        st = s.probe
        st.version = int(req.version)
        if req.weights_unchanged:
            return self._reload_or_revoke(
                s, NOOP_RELOAD, f"version {req.version}: the reload left the served weights "
                f"unchanged (fingerprint {req.weights_digest[:16] or '?'}) though its files changed")
        if req.error:
            st.verdict, st.reason = ERROR, req.error[:500]
            return pb.ProbeAck.OK, st.reason
        with self.lock:
            probe = self.probes.get(int(req.version))
        if probe is None:
            st.verdict, st.reason = ERROR, f"no probe kept for version {req.version}"
            return pb.ProbeAck.OK, st.reason
        recipe = s.recipe.get("name", "")
        device = s.device.get("type", "") or "cpu"
        bound = self._bound(s.group, bound_for(self.bounds, recipe, s.recipe.get("backend", ""),
                                               device))
        try:
            j = judge(probe, list(req.logprobs), list(req.previous_logprobs), bound,
                      margin=self.cfg.margin)
        except ProbeError as e:
            st.verdict, st.reason = ERROR, f"malformed report: {e}"
            return pb.ProbeAck.OK, st.reason
        st.kl, st.max_abs, st.verdict, st.reason = j.current.kl, j.current.max_abs, j.verdict, j.reason
        key = (probe.version, s.group)
        with self.lock:
            worst = self.by_group.get(key, (0.0, 0.0))
            self.by_group[key] = (max(worst[0], j.current.kl), max(worst[1], j.current.max_abs))
            if j.verdict != OLDER:  # the group's recent history, what bounds: run compares to
                base = self.baselines.setdefault(s.group, [])
                base.append((j.current.kl, j.current.max_abs))
                del base[:-RECENT]
        if j.verdict == OLDER:
            # Asked to reload, never revoked on this alone: a quantized export absorbs an update
            # below its resolution, so a healthy fp8 / mxfp4 sampler can sit closer to the
            # previous policy (make demo revoked two that way). A no-op reload is caught by the
            # fingerprint, which is hard evidence.
            st.verdict, st.reason = OLDER, f"version {req.version}: {j.reason}"
            if st.reload_requests < self.cfg.max_reloads:
                st.reload_requests += 1
                return pb.ProbeAck.RELOAD, st.reason
            return pb.ProbeAck.OK, st.reason
        if j.verdict == "above_bound":
            st.above_streak += 1
            line = (f"probe alarm: sampler {s.name} (group {s.group}, recipe {recipe}, {device}) "
                    f"on version {req.version}: {j.reason}"
                    + (f" ({st.above_streak} reports in a row)" if st.above_streak > 1 else ""))
            if st.above_streak < self.cfg.alarm_after:  # 64 tokens: single reports swing widely
                st.verified_version = max(st.verified_version, int(req.version))
                return pb.ProbeAck.OK, j.reason
            st.alarms += 1
            if not st.alarming:  # once when it goes above, not at every version
                log.warning(line)
                self.alarms.append(line)
            st.alarming = True
            # the weights it reported on did load: the version is verified, the precision alarms
            st.verified_version = max(st.verified_version, int(req.version))
            if self.cfg.enforce and bound.measured_on == device:
                return pb.ProbeAck.REVOKED, line
            return pb.ProbeAck.OK, line
        st.alarming, st.above_streak = False, 0
        st.verified_version = max(st.verified_version, int(req.version))
        st.reload_requests = 0
        return pb.ProbeAck.OK, j.reason

    def _bound(self, group: str, table: Bound) -> Bound:
        """The bound a report of ``group`` is judged against (``service.probe.bounds``)."""
        if self.cfg.bounds == "table":
            return table
        with self.lock:
            base = list(self.baselines.get(group, ()))
        if len(base) < self.cfg.baseline_versions:  # no baseline yet: nothing to alarm against
            return Bound(math.inf, math.inf, table.noise, measured_on="run")
        # A jump in KL over the group's recent median (a reload that broke scales, a wrong
        # export); slow drift as the policy sharpens is not a fault. max |Δ| swings too much
        # between versions to alarm on here.
        kl = max(table.kl, self.cfg.alarm_factor * statistics.median(b[0] for b in base))
        return Bound(kl, math.inf, table.noise, measured_on="run")

    def _reload_or_revoke(self, s: Session, verdict: str, reason: str) -> tuple[int, str]:
        st = s.probe
        st.verdict, st.reason = verdict, reason
        if st.reload_requests < self.cfg.max_reloads:
            st.reload_requests += 1
            return pb.ProbeAck.RELOAD, reason
        return pb.ProbeAck.REVOKED, f"{reason} (after {st.reload_requests} reload request(s))"

    def group_summary(self) -> dict[str, tuple[int, float, float]]:
        """Per group: (newest version with a report, worst probe KL, worst max |Δ|) on it."""
        out: dict[str, tuple[int, float, float]] = {}
        with self.lock:
            for (version, group), (kl, mx) in sorted(self.by_group.items()):
                out[group] = (version, kl, mx)
        return out


__all__ = ["BOUNDS_FILE", "DEFAULT_BOUND", "ProbeBook", "bound_for", "load_bounds"]
