"""The version probe: what a published version's ``probe.json`` holds, and how a sampler's answer
to it is judged.

At each publish the trainer samples a short continuation ``c`` of a few fixed prompts from its own
policy ``p_v`` (temperature 1, seeded) and writes the tokens into every format directory of the
version as ``probe.json`` (listed in its manifest, so deltas and object stores carry it). The
trainer's ``log p_v(c_t | prompt, c_<t)`` is not in it: a sampler could send those numbers back
and pass without scoring anything. The trainer keeps them in its run directory
(``trainer_jax.service.probes``, ``<run>/probes/v00000012.json``). After loading the version a
sampler scores the published tokens with its recipe (``log q``) and reports them (``ReportProbe``,
``docs/wire.md``). The trainer, which holds ``p``, computes:

- ``kl``: the k3 estimate of KL(p_v || q) on the probe tokens, which were drawn from p_v:
  ``mean_t [r_t - 1 - log r_t]`` with ``r_t = q(c_t) / p_v(c_t)`` (unbiased, never negative);
- ``max_abs``: ``max_t |log q(c_t) - log p_v(c_t)|``;
- the staleness verdict, on the *previous* version's continuation ``c'`` (carried in ``previous``
  with ``log p_{v-1}(c')`` and ``log p_v(c')``): the sampler serves v-1 rather than v when its
  ``log q(c')`` is closer to ``log p_{v-1}`` than to ``log p_v``. That is decidable only when the
  two versions differ by more than the recipe's own noise (``margin`` times the mean |Δ log p| the
  recipe shows at equal weights); otherwise the verdict is ``undecided``.

Only the standard library: both sides (and third-party samplers) read this module.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

PROBE_FILE = "probe.json"
#: 2: what is published (tokens only; the trainer's log p is kept in its run directory); 1: older
#: files, log p inside, still read (a version published before the change, a benchmark's case)
PROBE_FORMAT = 2
READ_FORMATS = (1, 2)

#: verdicts of one report, in the order they are decided
NOOP_RELOAD, ERROR, OLDER, ABOVE_BOUND, UNDECIDED, OK = (
    "noop_reload", "error", "older", "above_bound", "undecided", "ok")


#: float32 rounding of a peaked log-softmax (as ``trainer_jax.service.validation``): above it a
#: reported log-probability is malformed, not a probability
LOGPROB_TOL = 1e-5


class ProbeError(ValueError):
    """A probe file or a probe report is malformed."""


def _rows(value, where: str, kind: type) -> list[list]:
    if not isinstance(value, list) or not all(isinstance(r, list) for r in value):
        raise ProbeError(f"{where}: expected a list of lists")
    try:
        rows = [[kind(x) for x in r] for r in value]
    except (TypeError, ValueError) as e:
        raise ProbeError(f"{where}: {e}") from None
    if kind is float and any(not math.isfinite(x) or x > 0 for r in rows for x in r):
        raise ProbeError(f"{where}: log-probabilities must be finite and <= 0")
    return rows


def _same_shape(a: list[list], b: list[list], where: str) -> None:
    if [len(r) for r in a] != [len(r) for r in b]:
        raise ProbeError(f"{where}: shapes differ ({[len(r) for r in a]} vs {[len(r) for r in b]})")


@dataclasses.dataclass(frozen=True)
class PreviousProbe:
    """The previous version's continuation, scored by both versions."""

    version: int
    continuations: list[list[int]]
    logprobs: list[list[float]] | None = None      # log p_{v-1}: what the previous version gave them
    logprobs_now: list[list[float]] | None = None  # log p_v: what this version gives them


@dataclasses.dataclass(frozen=True)
class Probe:
    """The probe of version ``version``: the trainer's record (with its log p) or, with
    ``logprobs`` ``None``, what is published (``public()``, ``probe.json``)."""

    version: int
    seed: int
    prompts: list[list[int]]
    continuations: list[list[int]]
    logprobs: list[list[float]] | None  # log p_v(c_t | prompt, c_<t), float32; None: published
    previous: PreviousProbe | None = None
    temperature: float = 1.0

    def to_json(self) -> dict:
        """``PROBE_FORMAT``; log p only where the probe holds them (the trainer's record)."""
        d = dataclasses.asdict(self)
        for part in (d, d["previous"] or {}):
            for key in ("logprobs", "logprobs_now"):
                if key in part and part[key] is None:
                    del part[key]
        return {"probe_format": PROBE_FORMAT, **d}

    def public(self) -> Probe:
        """What a sampler gets: the tokens to score, none of the trainer's log p."""
        prev = self.previous
        return dataclasses.replace(
            self, logprobs=None,
            previous=None if prev is None else PreviousProbe(prev.version, prev.continuations))

    @property
    def has_logprobs(self) -> bool:
        """Whether reports can be judged against it (the trainer's record, or an older file)."""
        return self.logprobs is not None and (
            self.previous is None or (self.previous.logprobs is not None
                                      and self.previous.logprobs_now is not None))

    @classmethod
    def from_json(cls, data, where: str = PROBE_FILE) -> Probe:
        """Parse and check a decoded ``probe.json``; ``ProbeError`` names what is wrong."""
        if not isinstance(data, dict):
            raise ProbeError(f"{where}: expected a JSON object")
        fmt = data.get("probe_format")
        if fmt not in READ_FORMATS or isinstance(fmt, bool):
            raise ProbeError(f"{where}: probe_format {fmt!r}, expected one of "
                             f"{', '.join(map(str, READ_FORMATS))}")
        # Format 1 always carried log p; in format 2 they are there only in the trainer's record.
        def logp(part: dict, key: str, label: str) -> list[list[float]] | None:
            if fmt == 1 or key in part:
                return _rows(part[key], f"{where}: {label}", float)
            return None

        try:
            prompts = _rows(data["prompts"], f"{where}: prompts", int)
            conts = _rows(data["continuations"], f"{where}: continuations", int)
            lps = logp(data, "logprobs", "logprobs")
            prev = data.get("previous")
            previous = None
            if prev is not None:
                if not isinstance(prev, dict):
                    raise ProbeError(f"{where}: previous: expected an object")
                pc = _rows(prev["continuations"], f"{where}: previous.continuations", int)
                pl = logp(prev, "logprobs", "previous.logprobs")
                pn = logp(prev, "logprobs_now", "previous.logprobs_now")
                for rows in (pl, pn):
                    if rows is not None:
                        _same_shape(pc, rows, f"{where}: previous")
                if len(pc) != len(prompts):
                    raise ProbeError(f"{where}: previous has {len(pc)} continuations for "
                                     f"{len(prompts)} prompts")
                previous = PreviousProbe(int(prev["version"]), pc, pl, pn)
            probe = cls(int(data["version"]), int(data["seed"]), prompts, conts, lps, previous,
                        float(data.get("temperature", 1.0)))
        except KeyError as e:
            raise ProbeError(f"{where}: missing {e}") from None
        if len(conts) != len(prompts) or not prompts or any(not p for p in prompts):
            raise ProbeError(f"{where}: {len(prompts)} prompts (none empty) need as many "
                             f"continuations, got {len(conts)}")
        if lps is not None:
            _same_shape(conts, lps, where)
        return probe

    @property
    def tokens(self) -> int:
        return sum(len(c) for c in self.continuations)


def read_probe(directory: str | os.PathLike) -> Probe | None:
    """The probe of an export directory; ``None`` when it has none (published without one)."""
    path = Path(directory) / PROBE_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProbeError(f"{path}: {e}") from None
    return Probe.from_json(data, str(path))


def flatten(rows: Sequence[Sequence[float]]) -> list[float]:
    return [float(x) for r in rows for x in r]


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Sampler log q against trainer log p on the same tokens (drawn from p)."""

    kl: float         # k3 estimate of KL(p || q)
    max_abs: float    # max |log q - log p|
    mean_abs: float   # mean |log q - log p|
    tokens: int


def compare(logp: Sequence[float], logq: Sequence[float]) -> Comparison:
    """k3, max and mean |Δ| of ``logq`` against ``logp`` (flat, same length, tokens from p)."""
    if len(logp) != len(logq):
        raise ProbeError(f"{len(logq)} log-probabilities reported for {len(logp)} probe tokens")
    if not logp:
        return Comparison(0.0, 0.0, 0.0, 0)
    kl = mx = total = 0.0
    for a, b in zip(logp, logq, strict=True):
        if not math.isfinite(b) or b > LOGPROB_TOL:
            raise ProbeError(f"reported log-probability {b} is not finite and <= 0")
        d = min(max(b - a, -50.0), 50.0)  # log r, clipped so exp stays finite
        kl += math.exp(d) - 1.0 - d
        mx = max(mx, abs(b - a))
        total += abs(b - a)
    n = len(logp)
    return Comparison(kl / n, mx, total / n, n)


@dataclasses.dataclass(frozen=True)
class Bound:
    """What a recipe shows at equal weights, measured (``benchmarks/bench_probe.py``): the probe's
    KL and max |Δ| alarm above ``kl`` / ``max_abs``; ``noise`` is its mean |Δ log p|."""

    kl: float
    max_abs: float
    noise: float
    measured_on: str = ""   # the device kind the values come from ("cpu", "cuda"); "" if none


@dataclasses.dataclass(frozen=True)
class Judgement:
    verdict: str
    current: Comparison
    separation: float = 0.0   # mean |log p_v - log p_{v-1}| on the previous continuation
    reason: str = ""


def judge(probe: Probe, logq: Sequence[float], previous_logq: Sequence[float], bound: Bound, *,
          margin: float = 3.0) -> Judgement:
    """The verdict of one report (flat ``logq`` of ``probe.continuations``, ``previous_logq`` of
    ``probe.previous.continuations`` or empty): ``older`` when it decidably serves the previous
    version, ``above_bound`` when its KL or max |Δ| exceeds ``bound``, ``undecided`` when the two
    versions are closer than ``margin`` times the recipe's noise (the larger of ``bound.noise`` and
    the report's own distance to the nearer version: it then cannot tell), else ``ok``.
    ``ProbeError`` for a probe without log p (a published one: nothing to judge against)."""
    if not probe.has_logprobs:
        raise ProbeError(f"the probe of version {probe.version} holds no log p (a published "
                         f"{PROBE_FILE}): reports are judged against the trainer's record")
    current = compare(flatten(probe.logprobs), logq)
    separation, verdict, reason = 0.0, OK, ""
    prev = probe.previous
    if prev is not None and previous_logq:
        old = compare(flatten(prev.logprobs), previous_logq)
        new = compare(flatten(prev.logprobs_now), previous_logq)
        separation = compare(flatten(prev.logprobs), flatten(prev.logprobs_now)).mean_abs
        # The recipe's noise on this model now: its distance to whichever version it serves
        # (a trained model's sharper distributions show more than the measured table says).
        noise = max(bound.noise, min(old.mean_abs, new.mean_abs))
        if separation <= margin * noise:
            verdict = UNDECIDED
            reason = (f"versions {prev.version} and {probe.version} differ by {separation:.2e} "
                      f"(mean |Δ log p|), within {margin:g} x the recipe's noise {noise:.2e}")
        elif old.mean_abs < new.mean_abs:
            return Judgement(OLDER, current, separation,
                             f"its log-probabilities match version {prev.version} "
                             f"({old.mean_abs:.2e}) better than {probe.version} ({new.mean_abs:.2e})")
    if current.kl > bound.kl or current.max_abs > bound.max_abs:
        return Judgement(ABOVE_BOUND, current, separation,
                         f"probe KL {current.kl:.2e} / max |Δ| {current.max_abs:.3f} above the "
                         f"recipe's bound {bound.kl:.2e} / {bound.max_abs:.3f}")
    return Judgement(verdict, current, separation, reason)


__all__ = ["ABOVE_BOUND", "ERROR", "NOOP_RELOAD", "OK", "OLDER", "PROBE_FILE", "PROBE_FORMAT",
           "READ_FORMATS", "UNDECIDED", "Bound", "Comparison", "Judgement", "PreviousProbe", "Probe",
           "ProbeError", "compare", "flatten", "judge", "read_probe"]
