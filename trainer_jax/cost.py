"""What a mixed fleet costs and buys: replica-hours, USD and useful samples per sampler group.

A group's price is USD per replica-hour (``SamplerGroupConfig.price_per_hour``, or the config's
``prices:`` table keyed by its ``accelerator``). Each training step the ledger charges every group
its live replicas x the step's wall time (*realised* cost: idle replicas are paid for) and counts
what the group produced (samples accepted by the service) and what was trained from it. A trained
token is *useful* when the objective kept it: not masked for ``train.max_staleness`` (counted here,
``group/<g>/stale_share``: the objective never sees those), not dropped as an inconsistent record
and with its importance ratio inside [c_min, c_max] (the objective's ``group/<g>/dropped`` and
``group/<g>/out_of_range`` metrics; the latter is a share of the kept tokens). A group's useful
share is useful tokens / policy tokens; its useful samples are its trained samples x that share
(a token-weighted estimate of the per-sample shares, which the learner does not report).

USD per useful sample (token) = the group's USD so far / its useful samples (tokens) so far. A group
without a price has no USD figures at all (absent, never zero). Busy replica-hours (replicas x the
leased share of their capacity, integrated by the router) are reported beside: the cost at full
use, which policy ``cost`` routes on (``trainer_jax.service.router``).

Torch-free and JAX-free: the planner and the benchmarks read it too.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

_HOUR = 3600.0


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def accelerator_mismatch(expected: str | None, reported: str, device: Mapping | None) -> str | None:
    """Why a registering sampler's device does not look like its group's ``accelerator``, or None.

    The group's name is the price key (``H100``); the sampler reports a torch device (``{type:
    cuda, name: NVIDIA H100 80GB HBM3}``) and a free-text label (``mixrl-sample --accelerator``,
    default the device's name). A match: the key, letters and digits only and lower-cased, is the
    device's type (``cpu``) or part of its name, or (no device report) of the label. A mismatch is
    a warning, never a refusal: a group priced as an H100 may well run on a CPU in a test.
    """
    if not expected:
        return None
    key = _norm(expected)
    device = dict(device or {})
    if device:
        seen = [device.get("type", ""), device.get("name", "")]
        what = f"{device.get('type', '?')} {device.get('name', '')}".strip()
    else:
        seen, what = [reported], repr(reported or "nothing")
    if key and any(key == _norm(s) or (len(key) > 2 and key in _norm(s)) for s in seen if s):
        return None
    return f"priced as accelerator {expected!r} but reports {what}"


def useful_share(dropped: float | None, out_of_range: float | None) -> float | None:
    """Share of a group's policy tokens the objective kept in range: (1 - dropped) x (1 - oor).

    ``dropped`` is a share of loss-mask tokens, ``out_of_range`` a share of the kept (valid)
    ones, as ``trainer_jax.objective.loss`` reports them; None when the step had none of them.
    Every token dropped is a share of 0: the out-of-range mean is then over no token (NaN).
    """
    if dropped is None or not math.isfinite(dropped):
        return None
    if out_of_range is None or not math.isfinite(out_of_range):
        return 0.0 if dropped >= 1.0 else None
    return max(0.0, 1.0 - dropped) * max(0.0, 1.0 - out_of_range)


@dataclasses.dataclass
class GroupCost:
    """One group's running totals over the training loop."""

    name: str
    price_per_hour: float | None
    accelerator: str | None = None
    replica_s: float = 0.0
    busy_replica_s: float = 0.0
    samples_produced: int = 0
    samples_trained: int = 0
    tokens_trained: int = 0
    useful_samples: float = 0.0
    useful_tokens: float = 0.0

    @property
    def usd(self) -> float | None:
        return None if self.price_per_hour is None else self.price_per_hour * self.replica_s / _HOUR

    @property
    def usd_busy(self) -> float | None:
        return None if self.price_per_hour is None else self.price_per_hour * self.busy_replica_s / _HOUR

    def per(self, amount: float, busy: bool = False) -> float | None:
        usd = self.usd_busy if busy else self.usd
        return None if usd is None or amount <= 0 else usd / amount

    def summary(self) -> dict:
        share = self.useful_tokens / self.tokens_trained if self.tokens_trained else None
        out = {"accelerator": self.accelerator, "price_per_hour": self.price_per_hour,
               "replica_hours": self.replica_s / _HOUR, "busy_replica_hours": self.busy_replica_s / _HOUR,
               "samples_produced": self.samples_produced, "samples_trained": self.samples_trained,
               "tokens_trained": self.tokens_trained, "useful_samples": self.useful_samples,
               "useful_tokens": self.useful_tokens, "useful_share": share}
        if self.price_per_hour is not None:
            out.update(usd=self.usd, usd_busy=self.usd_busy,
                       usd_per_useful_sample=self.per(self.useful_samples),
                       usd_per_useful_token=self.per(self.useful_tokens),
                       usd_busy_per_useful_sample=self.per(self.useful_samples, busy=True))
        return out


@dataclasses.dataclass
class StepCounts:
    """What one step saw of one group (the ledger's input; plain numbers, hand-checkable)."""

    replicas: int = 0               # live samplers of the group
    produced_total: int = 0         # training samples the service accepted from it so far
    busy_replica_s_total: float = 0.0  # the router's busy replica-seconds so far (cumulative)
    samples_trained: int = 0        # this step
    tokens_trained: int = 0         # this step's policy tokens
    useful_share: float | None = None


class CostLedger:
    """Per-group replica-hours, USD and useful samples, stepped once per training step."""

    def __init__(self, prices: Mapping[str, float | None],
                 accelerators: Mapping[str, str | None] | None = None):
        accelerators = accelerators or {}
        self.groups = {g: GroupCost(g, p, accelerators.get(g)) for g, p in prices.items()}
        self.steps = 0
        self.usd_total = 0.0

    @property
    def priced(self) -> bool:
        return any(g.price_per_hour is not None for g in self.groups.values())

    def step(self, wall_s: float, counts: Mapping[str, StepCounts]) -> dict[str, float]:
        """Charge ``wall_s`` seconds of every group's replicas and count the step's samples;
        return the step's metrics (USD ones only for priced groups)."""
        usd_step = 0.0
        values: dict[str, float] = {}
        for name, c in counts.items():
            g = self.groups.setdefault(name, GroupCost(name, None))
            g.replica_s += c.replicas * wall_s
            g.busy_replica_s = max(g.busy_replica_s, c.busy_replica_s_total)
            g.samples_produced = max(g.samples_produced, c.produced_total)
            g.samples_trained += c.samples_trained
            g.tokens_trained += c.tokens_trained
            if c.useful_share is not None:
                g.useful_samples += c.samples_trained * c.useful_share
                g.useful_tokens += c.tokens_trained * c.useful_share
                values[f"group/{name}/useful_share"] = c.useful_share
            values[f"group/{name}/replica_hours"] = g.replica_s / _HOUR
            values[f"group/{name}/busy_replica_hours"] = g.busy_replica_s / _HOUR
            values[f"group/{name}/samples_produced_total"] = g.samples_produced
            values[f"group/{name}/samples_trained_total"] = g.samples_trained
            if g.price_per_hour is None:
                continue
            usd_step += g.price_per_hour * c.replicas * wall_s / _HOUR
            values[f"group/{name}/usd_total"] = g.usd
            for key, value in ((f"group/{name}/usd_per_useful_sample", g.per(g.useful_samples)),
                               (f"group/{name}/usd_per_useful_token", g.per(g.useful_tokens))):
                if value is not None:
                    values[key] = value
        self.steps += 1
        if self.priced:
            self.usd_total += usd_step
            values["cost/usd_per_step"] = usd_step
            values["cost/usd_total"] = self.usd_total
            overall = self.overall()
            for key in ("usd_per_useful_sample", "usd_busy_per_useful_sample"):
                if overall.get(key) is not None:
                    values[f"cost/{key}"] = overall[key]
        return values

    def overall(self) -> dict:
        """The priced groups together: USD (realised and busy) per useful sample and token."""
        priced = [g for g in self.groups.values() if g.price_per_hour is not None]
        if not priced:
            return {}
        usd = sum(g.usd for g in priced)
        busy = sum(g.usd_busy for g in priced)
        samples = sum(g.useful_samples for g in priced)
        tokens = sum(g.useful_tokens for g in priced)
        return {"usd_total": usd, "usd_busy_total": busy,
                "usd_per_useful_sample": usd / samples if samples > 0 else None,
                "usd_per_useful_token": usd / tokens if tokens > 0 else None,
                "usd_busy_per_useful_sample": busy / samples if samples > 0 else None}

    def summary(self) -> dict:
        """summary.json's ``"cost"`` section."""
        replica_s = sum(g.replica_s for g in self.groups.values())
        useful = sum(g.useful_samples for g in self.groups.values())
        trained_tokens = sum(g.tokens_trained for g in self.groups.values())
        return {"steps": self.steps, "replica_hours": replica_s / _HOUR,
                "useful_samples": useful,
                "useful_share": (sum(g.useful_tokens for g in self.groups.values()) / trained_tokens
                                 if trained_tokens else None),
                **self.overall(), "groups": {n: g.summary() for n, g in self.groups.items()}}


def step_counts(status: Mapping, group_names: list[str], trained: Mapping[str, tuple[int, int]],
                values: Mapping[str, float], fresh: Mapping[str, float] | None = None
                ) -> dict[str, StepCounts]:
    """The ledger's input from the service's ``status()``, the step's trained (samples, tokens)
    per group and the step's metrics (``group/<g>/dropped`` / ``out_of_range``). ``fresh``: the
    share of each group's policy tokens within ``train.max_staleness`` (the rest were masked out
    of the loss before the objective saw them, so its dropped share does not count them)."""
    groups = status.get("groups", {})
    out = {}
    for name in group_names:
        g = groups.get(name, {})
        n, tokens = trained.get(name, (0, 0))
        share = useful_share(values.get(f"group/{name}/dropped"), values.get(f"group/{name}/out_of_range"))
        kept = (fresh or {}).get(name)
        if kept is not None:
            share = 0.0 if kept <= 0 else (None if share is None else share * kept)
        produced = int(g.get("accepted", 0)) - int(g.get("eval_accepted", 0))  # training samples
        out[name] = StepCounts(replicas=int(g.get("samplers", 0)), produced_total=produced,
                               busy_replica_s_total=float(g.get("busy_replica_s", 0.0)),
                               samples_trained=n, tokens_trained=tokens,
                               useful_share=share if n else None)
    return out


def router_feedback(values: Mapping[str, float], name: str,
                    staleness: float | None = None) -> dict[str, float | None]:
    """What the trainer feeds policy cost for group ``name`` after a step (``Router.observe``):
    its useful share, probe KL (else trained k3), out-of-range share and mean staleness
    (``staleness``: of all its trained policy tokens, before ``train.max_staleness`` masked any;
    the objective's ``group/<g>/staleness`` averages only the tokens within it, so it can never
    exceed the bound)."""
    probe = values.get(f"group/{name}/probe_kl")
    return {"useful_share": values.get(f"group/{name}/useful_share"),
            "k3": probe if probe is not None else values.get(f"group/{name}/k3"),
            "out_of_range": values.get(f"group/{name}/out_of_range"),
            "staleness": staleness if staleness is not None else values.get(f"group/{name}/staleness")}


def status_text(values: Mapping[str, float]) -> str:
    """The status line's cost part: `` $1.23 ($0.0041/useful)``; empty without prices."""
    if "cost/usd_total" not in values:
        return ""
    text = f" ${values['cost/usd_total']:.2f}"
    if values.get("cost/usd_per_useful_sample") is not None:
        text += f" (${values['cost/usd_per_useful_sample']:.2g}/useful)"
    return text


class TrainerCost:
    """The training loop's side: one ledger, stepped with the step's samples, feeding the router.

    ``step`` is called once per training step with the service, the step's packed samples and the
    indices trained, and the step's metrics so far; it returns the cost metrics and passes each
    group's useful share, k3 (probe KL where reported), out-of-range share and staleness to the
    router (under the scheduler's lock: the router is not thread-safe).
    """

    def __init__(self, prices: Mapping[str, float | None], accelerators: Mapping[str, str | None],
                 clock=None):
        import time

        self.ledger = CostLedger(prices, accelerators)
        self.clock = clock or time.perf_counter
        self._last = self.clock()

    def step(self, service, group_names: list[str], samples, taken, values: Mapping[str, float]) -> dict:
        now = self.clock()
        wall_s, self._last = now - self._last, now
        version = values.get("version")  # the trainer version the step's batch was packed at
        cap = getattr(service.router, "max_staleness", None)  # train.max_staleness
        # per group: samples, policy tokens, tokens over the cap, versions behind summed
        trained: dict[str, list[float]] = {g: [0, 0, 0, 0.0] for g in group_names}
        for i in taken:
            s = samples[i]
            name = group_names[s.group] if 0 <= s.group < len(group_names) else None
            if name is not None:
                t = trained[name]
                t[0] += 1
                t[1] += int(s.loss_mask.sum())
                if version is not None:
                    behind = int(version) - s.versions
                    t[2] += int((behind > cap).sum()) if cap is not None else 0
                    t[3] += float(behind.sum())
        status = service.status()
        fresh = ({g: 1.0 - t[2] / t[1] for g, t in trained.items() if t[1]}
                 if cap is not None and version is not None else None)
        counts = step_counts(status, group_names, {g: (int(t[0]), int(t[1])) for g, t in trained.items()},
                             values, fresh)
        out = self.ledger.step(wall_s, counts)
        for name, kept in (fresh or {}).items():  # tokens masked out of the loss for staleness
            out[f"group/{name}/stale_share"] = 1.0 - kept
        for name, g in status.get("groups", {}).items():  # the router's split, whichever policy
            out[f"group/{name}/lease_share"] = float(g.get("share", 0.0))
            if g.get("samples_per_busy_s"):  # what policy cost routes on (and a planner may read)
                out[f"group/{name}/samples_per_busy_replica_s"] = float(g["samples_per_busy_s"])
        merged = {**values, **out}
        behind = {g: t[3] / t[1] for g, t in trained.items() if t[1] and version is not None}
        with service.scheduler.lock:
            for name in group_names:
                service.router.observe(name, **router_feedback(merged, name, behind.get(name)))
        return out
