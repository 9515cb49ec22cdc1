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
   ``baseline_versions``), never below the measured table's bound nor above ``MAX_RUN_KL`` (1
   nat a token: a sampler sending numbers it did not compute alarms even before the group has a
   baseline, and cannot become its own): a jump, not the slow growth
   of the mismatch as the policy sharpens — a recipe's mismatch depends on the model
   (on the demo's trained policy, nvfp4_w4a4 shows a probe KL near 0.1 where the table's tiny
   random policies show 4e-4). ``bounds: table``: the measured bound (per recipe, backend and device
   kind: ``probe_bounds.json``, ``benchmarks/bench_probe.py``) as is; with
   ``service.probe.enforce`` the sampler is then revoked, but only where the bound was measured on
   its device kind (CPU-measured bounds alarm, never enforce, on a GPU).

A report that passes sets the sampler's ``verified_version``. Samplers that never report stay
``unverified`` (verified_version -1), which ``Status`` and the status line show.

**What reports are judged against.** The published ``probe.json`` holds the tokens only; a
report that sends back what it holds has no log p to send. The trainer keeps each version's
probe with its log p in memory and in its run directory (``<run>/probes/v00000012.json``,
``write_record``, never published). ``mixrl-train serve`` publishes a directory without a
trainer: its probe's log p come from the record of the run directory (``run.dir``) or of the
directory the versions sit in (``<run>/weights/v.../`` -> ``<run>/probes``); an older
``probe.json`` with log p inside is used as is. With no record found, that version's reports are
not judged: each gets the verdict ``error`` naming the missing record (``Status`` shows it).
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import tempfile
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
#: ``bounds: run`` never takes a probe KL above this for a group's normal, not even before its
#: baseline: the worst healthy recipe seen (nvfp4_w4a4 on the demo's trained policy) shows ~0.1,
#: a sampler that sends numbers it did not compute (log q = 0 everywhere, a constant) several
#: nats a token, and would otherwise be its own baseline.
MAX_RUN_KL = 1.0


#: the trainer's probe records (with log p) in the run directory, never published
RECORD_DIR = "probes"


def record_path(directory: str | Path, version: int) -> Path:
    """Where the record of ``version`` lives under ``directory`` (``<run>/probes``)."""
    return Path(directory) / f"v{int(version):08d}.json"


def write_record(directory: str | Path, probe: Probe) -> Path:
    """Keep ``probe`` (with its log p) as ``directory/v{version:08d}.json``, written to a
    temporary file and renamed: a reader sees the whole record or none."""
    path = record_path(directory, probe.version)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(probe.to_json(), f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def prune_records(directory: str | Path, keep: int) -> None:
    """Remove all but the ``keep`` newest records (versions no sampler loads any more)."""
    found = sorted(Path(directory).glob("v" + "[0-9]" * 8 + ".json"))
    for old in found[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)


def read_record(directory: str | Path, published: Probe) -> Probe | None:
    """The record under ``directory`` of ``published``'s version, if there is one with log p and
    the very tokens that were published (a record of another run is not used)."""
    path = record_path(directory, published.version)
    if not path.is_file():
        return None
    try:
        record = Probe.from_json(json.loads(path.read_text()), str(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, ProbeError) as e:
        log.warning("probe record %s unusable: %s", path, e)
        return None
    if record.public() != published.public() or not record.has_logprobs:
        log.warning("probe record %s is not the record of the published probe (other tokens, or "
                    "no log p): not used", path)
        return None
    return record


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
        #: where ``add_from_dir`` looks for the trainer's records first (``<run.dir>/probes``)
        self.record_dir: Path | None = None
        #: version -> why its reports cannot be judged (a published probe without its record)
        self.unjudged: dict[int, str] = {}

    def add(self, probe: Probe) -> None:
        """Keep ``probe`` (with its log p: the trainer's own) to judge its version's reports."""
        with self.lock:
            self.probes[probe.version] = probe
            self.unjudged.pop(probe.version, None)
            for old in sorted(self.probes)[:-self.keep]:
                del self.probes[old]

    def add_from_dir(self, version: int, directory: str | Path) -> None:
        """The probe of a local export directory (``mixrl-train serve``), if any: its log p from
        the trainer's record (see the module docstring), or from an older ``probe.json``."""
        from mixrl_wire.probe import read_probe

        try:
            probe = read_probe(directory)
        except ProbeError as e:
            log.warning("version %d: %s (no probe for this version)", version, e)
            return
        if probe is None:
            return
        # The record first, even where the file has log p: those of a format-1 file are used only
        # when the run kept no record of its own.
        places = self._record_places(Path(directory))
        record = next((r for r in (read_record(d, probe) for d in places) if r is not None), None)
        if record is None and not probe.has_logprobs:
            why = (f"the trainer's log p of version {probe.version} is in none of "
                   f"{', '.join(str(record_path(d, probe.version)) for d in places)}: "
                   "reports are not judged")
            log.warning("%s", why)
            with self.lock:
                self.unjudged[probe.version] = why
            return
        self.add(record or probe)

    def _record_places(self, directory: Path) -> list[Path]:
        """``record_dir``, then ``probes/`` beside the versions' root: an export sits at
        ``<run>/weights/v.../<format>`` or ``<run>/weights/v...``."""
        places = [] if self.record_dir is None else [self.record_dir]
        for up in list(directory.absolute().parents)[:3]:
            if up.name == "weights" and (up.parent / RECORD_DIR) not in places:
                places.append(up.parent / RECORD_DIR)
        return places

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
            unjudged = self.unjudged.get(int(req.version))
        if probe is None:
            st.verdict, st.reason = ERROR, unjudged or f"no probe kept for version {req.version}"
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
        if len(base) < self.cfg.baseline_versions:  # no baseline yet: only the absurd alarms
            return Bound(max(table.kl, MAX_RUN_KL), math.inf, table.noise, measured_on="run")
        # A jump in KL over the group's recent median (a reload that broke scales, a wrong
        # export); slow drift as the policy sharpens is not a fault. max |Δ| swings too much
        # between versions to alarm on here.
        kl = max(table.kl, min(MAX_RUN_KL, self.cfg.alarm_factor * statistics.median(b[0] for b in base)))
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


__all__ = ["BOUNDS_FILE", "DEFAULT_BOUND", "RECORD_DIR", "ProbeBook", "bound_for", "load_bounds",
           "prune_records", "read_record", "record_path", "write_record"]
