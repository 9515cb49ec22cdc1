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

Across ``mixrl-train --resume`` the ledger continues: its running totals are part of every
checkpoint (``CostLedger.state``, in the checkpoint's meta, so they commit with the step they
belong to) and the resumed run starts from the restored step's totals (``ledger_from_checkpoint``).
Steps after that checkpoint which the killed run had trained are trained again and charged again:
they ran again, and the replicas were paid for twice (the first run's charges for them went aside
with their metric records, ``metrics.discarded.jsonl``). Prices may change between the runs:
the totals so far keep the USD they were charged at, new steps are charged at the new prices (a
group priced only from the resume on is charged from there; one no longer priced has no USD
figures). The service's cumulative counters (busy replica-seconds, samples produced) restart with
the new service and are added to the restored totals.

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


def illustrative_prices(groups) -> dict[str, str]:
    """``{group: accelerator}`` of the groups whose prices are illustrative: spawned with ``device:
    cpu`` (the config itself says they compute on this host's CPU) and priced as an accelerator
    the CPU does not match. Their samplers are not checked against that accelerator at
    registration (the check's warning would only repeat the config), and ``illustrative_line``
    says so once; a group on ``device: auto`` that lands on the CPU still warns."""
    cpu = {"type": "cpu", "name": ""}
    return {g.name: g.accelerator for g in groups
            if g.spawn and g.device == "cpu" and g.accelerator
            and accelerator_mismatch(g.accelerator, "", cpu) is not None}


def illustrative_line(groups) -> str | None:
    """The one start-up line for ``illustrative_prices`` (None when there are none)."""
    priced = illustrative_prices(groups)
    if not priced:
        return None
    named = ", ".join(f"{g} as {a}" for g, a in priced.items())
    return (f"prices are illustrative: groups priced {named} compute on this host's CPU "
            "(device: cpu); their USD figures are what those accelerators would cost")


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


@dataclasses.dataclass(frozen=True)
class GroupTotals:
    """A group's totals at the restored checkpoint (what its USD was charged at, and the base the
    new service's cumulative counters add to)."""

    replica_s: float = 0.0
    busy_replica_s: float = 0.0
    samples_produced: int = 0
    usd: float = 0.0
    usd_busy: float = 0.0


_NO_TOTALS = GroupTotals()


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
    # Restored from a checkpoint (``CostLedger.restore``): the totals then, whose USD stays at the
    # price it was charged at; only what is added since is charged at ``price_per_hour``.
    resumed: GroupTotals | None = None

    @property
    def usd(self) -> float | None:
        if self.price_per_hour is None:
            return None
        r = self.resumed or _NO_TOTALS
        return r.usd + self.price_per_hour * (self.replica_s - r.replica_s) / _HOUR

    @property
    def usd_busy(self) -> float | None:
        if self.price_per_hour is None:
            return None
        r = self.resumed or _NO_TOTALS
        return r.usd_busy + self.price_per_hour * (self.busy_replica_s - r.busy_replica_s) / _HOUR

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


STATE_VERSION = 1
_INT_COUNTS = ("samples_produced", "samples_trained", "tokens_trained")
_COUNTS = ("replica_s", "busy_replica_s", *_INT_COUNTS, "useful_samples", "useful_tokens")


class LedgerStateError(ValueError):
    """A checkpoint's ledger state that cannot be read; the message is one line naming it."""


def _number(d: Mapping, key: str, kind: type = float, where: str = "", optional: bool = False):
    value = d.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (kind is int and value != int(value)):
        want = "a whole number" if kind is int else "a number"
        raise LedgerStateError(f"{where}{key!r} is {value!r}, not {want} >= 0")
    return kind(value)


class CostLedger:
    """Per-group replica-hours, USD and useful samples, stepped once per training step."""

    def __init__(self, prices: Mapping[str, float | None],
                 accelerators: Mapping[str, str | None] | None = None):
        accelerators = accelerators or {}
        self.groups = {g: GroupCost(g, p, accelerators.get(g)) for g, p in prices.items()}
        self.steps = 0
        self.usd_total = 0.0
        self.from_step = 0  # the training step the totals count from (> 0: they restarted there)

    def state(self) -> dict:
        """The running totals as plain JSON numbers, for the checkpoint (``restore`` reads them)."""
        return {"version": STATE_VERSION, "steps": self.steps, "usd_total": self.usd_total,
                "from_step": self.from_step,
                "groups": {n: {"price_per_hour": g.price_per_hour, "accelerator": g.accelerator,
                               **{k: getattr(g, k) for k in _COUNTS}, "usd": g.usd, "usd_busy": g.usd_busy}
                           for n, g in self.groups.items()}}

    def restore(self, state: object) -> None:
        """Continue from ``state`` (``state()`` of the checkpointed step); ``LedgerStateError``
        (one line, the ledger untouched) when it is not one. The configured price and accelerator
        of a group win; a group no longer configured keeps its saved ones (and its totals)."""
        if not isinstance(state, Mapping):
            raise LedgerStateError(f"not a mapping but {type(state).__name__}")
        if state.get("version") != STATE_VERSION:
            raise LedgerStateError(f"version {state.get('version')!r}, this trainer reads {STATE_VERSION}")
        steps, from_step = _number(state, "steps", int), _number(state, "from_step", int)
        usd_total = _number(state, "usd_total")
        saved = state.get("groups")
        if not isinstance(saved, Mapping):
            raise LedgerStateError("'groups' is not a mapping")
        groups = {}
        for name, g in saved.items():
            if not isinstance(g, Mapping):
                raise LedgerStateError(f"group {name!r} is not a mapping")
            where = f"group {name!r}: "
            counts = {k: _number(g, k, int if k in _INT_COUNTS else float, where) for k in _COUNTS}
            usd, busy, price = (_number(g, k, float, where, optional=True)
                                for k in ("usd", "usd_busy", "price_per_hour"))
            known = self.groups.get(name)
            if known is None and not (g.get("accelerator") is None or isinstance(g["accelerator"], str)):
                raise LedgerStateError(f"group {name!r}: 'accelerator' is not a string")
            out = (dataclasses.replace(known, **counts) if known is not None
                   else GroupCost(name, price, g.get("accelerator"), **counts))
            out.resumed = GroupTotals(counts["replica_s"], counts["busy_replica_s"],
                                      counts["samples_produced"], usd or 0.0, busy or 0.0)
            groups[name] = out
        self.groups.update(groups)
        self.steps, self.from_step, self.usd_total = steps, from_step, usd_total

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
            base = g.resumed or _NO_TOTALS  # the service's counters restart with a resumed run
            g.replica_s += c.replicas * wall_s
            g.busy_replica_s = max(g.busy_replica_s, base.busy_replica_s + c.busy_replica_s_total)
            g.samples_produced = max(g.samples_produced, base.samples_produced + c.produced_total)
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
        """summary.json's ``"cost"`` section (``from_step`` > 0: the totals restarted there)."""
        replica_s = sum(g.replica_s for g in self.groups.values())
        useful = sum(g.useful_samples for g in self.groups.values())
        trained_tokens = sum(g.tokens_trained for g in self.groups.values())
        return {"steps": self.steps, "from_step": self.from_step, "replica_hours": replica_s / _HOUR,
                "useful_samples": useful,
                "useful_share": (sum(g.useful_tokens for g in self.groups.values()) / trained_tokens
                                 if trained_tokens else None),
                **self.overall(), "groups": {n: g.summary() for n, g in self.groups.items()}}


def ledger_from_checkpoint(prices: Mapping[str, float | None], accelerators: Mapping[str, str | None],
                           meta: Mapping | None) -> tuple[CostLedger, str | None]:
    """The ledger a run continues with, and a warning line if it cannot continue the restored one.

    ``meta``: the restored checkpoint's meta (None: nothing was restored, a fresh ledger). Without
    a ``"cost"`` entry (a checkpoint from before the ledger was saved) or with one that cannot be
    read, the totals start at 0 from the restored step, and the line says so: a warning, not a
    refusal, because the ledger is a report, not training state; the checkpoint's model and
    optimizer are fine, the totals until then stay in ``metrics.jsonl``'s kept records, and
    summary.json's ``from_step`` marks the undercount. Refusing would strand the run with no way
    to resume it short of deleting its checkpoints.
    """
    ledger = CostLedger(prices, accelerators)
    if meta is None:
        return ledger, None
    step = int(meta.get("step", 0))
    state = meta.get("cost")
    if state is None:
        problem = "has no cost ledger (written before the ledger was checkpointed)"
    else:
        try:
            ledger.restore(state)
            return ledger, None
        except LedgerStateError as e:
            problem = f"has an unreadable cost ledger ({e})"
    ledger.from_step = step
    return ledger, (f"checkpoint step {step} {problem}: cost totals start at 0 from step {step} "
                    "(summary.json's cost covers the steps after it only)")


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
                 clock=None, ledger: CostLedger | None = None):
        import time

        self.ledger = ledger if ledger is not None else CostLedger(prices, accelerators)
        self.clock = clock or time.perf_counter
        self._last = self.clock()

    def start(self) -> None:
        """The training loop starts now: the first step is charged from here (not from setup)."""
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
