"""``mixrl-train plan``: which sampler pool to buy, from what a run measured.

    mixrl-train plan RUN_DIR --budget USD_PER_HOUR [--config RUN_CONFIG] [--prices FILE]
                     [--limits FILE] [--out plan.yaml] [--min GROUP=N ...] [--max GROUP=N ...]

Reads the run's per-group measurements from ``metrics.jsonl`` (mean over the last half of its RL
steps): tokens/s per replica, tokens per sample, useful share (``group/<g>/useful_share`` where the
run wrote it, else 1 - out-of-range - dropped share), k3, its growth over the run, out-of-range
share, staleness and probe KL. Groups that break a stability limit (``--limits``; default
``experiments/plan_limits.yaml``, measured by issue 48's grid: probe KL and the out-of-range share a
group adds; ``--limits writeup``: the write-up's figures) get no replica; the rest get the replica
counts maximising useful samples per hour within the budget (``experiments.plan_solve.solve``:
exact). Writes ``plan.yaml``: a ``groups:`` list of ``{name, accelerator, processes,
price_per_hour}`` that ``mixrl-train --plan`` merges into a run config and ``mixrl-fleet up
--plan`` applies (``trainer_jax.plan_file.plan_overrides``); the other keys record how the plan
was made.

Prices and accelerators come from ``--config`` (the config the run was started with: its groups'
``accelerator`` / ``price_per_hour`` and ``prices:``) or from the run's ``summary.json`` cost
section; ``--prices FILE`` (accelerator -> USD per replica-hour) adds to or replaces those.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import yaml

from experiments.plan_solve import Item, Limits, check_limits, load_limits, solve
from trainer_jax.plan_file import PlanError

WINDOW = 0.5  # the share of the run's last RL steps the measurements average over


def _mean(values: list) -> float:
    xs = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(xs) / len(xs) if xs else math.nan


@dataclasses.dataclass
class GroupMeasure:
    """One group's measurements from a run (NaN: not measured)."""

    name: str
    tokens_per_s: float  # the group's total (the router's moving average)
    tokens_per_sample: float
    useful_share: float
    useful_from: str
    k3: float
    k3_growth: float
    out_of_range: float
    staleness: float
    probe_kl: float
    replicas: float = 1.0
    replicas_from: str = "assumed 1"
    accelerator: str | None = None
    price: float | None = None
    k3_ratio: float = math.nan
    max_count: int | None = None
    rate: float = math.nan  # useful samples per (busy) replica-hour from the cost ledger
    rate_from: str = ""
    rl_steps: int | None = None  # the RL steps its measurements come from (None: unknown)
    #: out_of_range over the reference group's (the lowest probe KL in the run; NaN without one)
    out_of_range_added: float = math.nan

    @property
    def useful_per_hour(self) -> float:
        """Useful samples per replica-hour: the cost ledger's where the run has it, else from the
        router's tokens/s per replica (realised: idle time included) and tokens per sample."""
        if not math.isnan(self.rate):
            return self.rate
        if not self.tokens_per_sample > 0:  # NaN (no sample) or 0 (no token kept): unmeasured
            return math.nan
        per_replica = self.tokens_per_s / max(self.replicas, 1e-9)
        return per_replica / self.tokens_per_sample * 3600 * self.useful_share

    def limit_values(self) -> dict[str, float | None]:
        return {"k3": self.k3, "k3_ratio": self.k3_ratio, "k3_growth": self.k3_growth,
                "out_of_range": self.out_of_range, "out_of_range_added": self.out_of_range_added,
                "staleness": self.staleness, "probe_kl": self.probe_kl}


def read_run(run_dir: str | Path, window: float = WINDOW,
             records: list[dict] | None = None) -> dict[str, GroupMeasure]:
    """Per-group measurements of a run directory's ``metrics.jsonl`` (or of ``records`` already
    read from it, e.g. an archived run's gzipped copy)."""
    from trainer_jax.diagnostics import read_metrics

    if records is None:
        try:
            records = read_metrics(run_dir)
        except (FileNotFoundError, ValueError) as e:
            raise PlanError(str(e)) from None
    steps = [r for r in records if r.get("step", -1) >= 0 and any(k.startswith("group/") for k in r)]
    names = sorted({k.split("/")[1] for r in steps for k in r
                    if k.startswith("group/") and k.count("/") >= 2})
    if not names:
        raise PlanError(f"{Path(run_dir) / 'metrics.jsonl'}: no per-group step metrics (group/<name>/...); "
                        "the run trained no step")
    last = steps[-max(1, math.ceil(len(steps) * window)):]
    third = max(1, len(steps) // 3)
    out = {}
    for g in names:
        def col(key: str, rows: list[dict] = last, g: str = g) -> list:
            return [r.get(f"group/{g}/{key}") for r in rows]

        tokens = sum(v for v in col("tokens") if v is not None)
        samples = sum(r.get(f"group/{g}/sample_share", 0.0) * r.get("samples_trained", 0.0) for r in last)
        useful = _mean(col("useful_share"))
        useful_from = "group/<g>/useful_share"
        if math.isnan(useful):  # a run from before trainer_jax.cost: its formula, from the metrics
            oor, dropped = _mean(col("out_of_range")), _mean(col("dropped"))
            useful = (1.0 - dropped) * (1.0 - oor)  # NaN where the group had no trained token
            useful_from = "(1 - dropped) x (1 - out_of_range)"
        first_k3, last_k3 = _mean(col("k3", steps[:third])), _mean(col("k3", steps[-third:]))
        out[g] = GroupMeasure(
            name=g, tokens_per_s=_mean(col("tokens_per_s")),
            tokens_per_sample=tokens / samples if samples > 0 else math.nan,
            useful_share=useful, useful_from=useful_from, k3=_mean(col("k3")),
            k3_growth=last_k3 / first_k3 if len(steps) >= 3 and first_k3 > 0 else math.nan,
            out_of_range=_mean(col("out_of_range")), staleness=_mean(col("staleness")),
            probe_kl=_mean(col("probe_kl")), rl_steps=len(steps))
        out[g].rate, out[g].rate_from = _ledger_rate(g, steps, last, useful)
    k3s = [m.k3 for m in out.values() if m.k3 > 0]
    for m in out.values():
        m.k3_ratio = m.k3 / min(k3s) if k3s and not math.isnan(m.k3) else math.nan
    _out_of_range_added(out)
    _replicas_from_logs(Path(run_dir), out)
    return out


def _out_of_range_added(groups: dict[str, GroupMeasure]) -> None:
    """What each group's precision adds to the out-of-range share: its share over the reference
    group's, the one with the lowest probe KL (the closest to the trainer's numerics). Every group of
    an asynchronous run trains on samples about equally stale, so the stale part of the share is
    common and cancels; with no second group measured there is no reference (NaN: not judged)."""
    probed = [m for m in groups.values() if not math.isnan(m.probe_kl) and not math.isnan(m.out_of_range)]
    if len(probed) < 2:
        return
    ref = min(probed, key=lambda m: m.probe_kl)
    for m in groups.values():
        if not math.isnan(m.out_of_range):
            m.out_of_range_added = max(0.0, m.out_of_range - ref.out_of_range)


def _ledger_rate(g: str, steps: list[dict], last: list[dict], useful: float) -> tuple[float, str]:
    """Useful samples per replica-hour from ``trainer_jax.cost``'s cumulative counters over the
    window: samples the group *produced* (accepted by the service, trained or not: what a replica
    can deliver, whether or not this run's trainer kept up) x its useful share, per *busy*
    replica-hour (at full use, as policy cost routes) where the run has them, else per
    replica-hour (idle time included); NaN for a run from before the ledger."""
    before = steps[len(steps) - len(last) - 1] if len(steps) > len(last) else {}

    def delta(key: str) -> float:
        end, start = last[-1].get(f"group/{g}/{key}"), before.get(f"group/{g}/{key}", 0.0)
        return math.nan if end is None or start is None else end - start

    produced = delta("samples_produced_total")
    for key, label in (("busy_replica_hours", "busy replica-h"), ("replica_hours", "replica-h")):
        hours = delta(key)
        if hours > 0 and produced > 0 and not math.isnan(useful):
            return produced * useful / hours, label
    return math.nan, ""


def _replicas_from_logs(run_dir: Path, groups: dict[str, GroupMeasure]) -> None:
    """Spawned samplers log to ``logs/<group>-<i>.log``: their count, where metrics gave none."""
    for g, m in groups.items():
        if m.replicas_from != "assumed 1":
            continue
        n = sum(1 for p in (run_dir / "logs").glob(f"{g}-*.log") if p.stem[len(g) + 1:].isdigit())
        if n:
            m.replicas, m.replicas_from = float(n), "logs/"


def attach_prices(groups: dict[str, GroupMeasure], run_dir: str | Path, config: str | None,
                  prices: str | None) -> None:
    """Accelerator, price and replica bounds per group from ``--config`` or ``summary.json``'s cost
    section, with ``--prices`` over them; every group must end up priced."""
    from trainer_jax.config import ConfigError, load_config, read_prices

    try:
        table = read_prices(prices) if prices else {}
        if config:
            cfg = load_config(config, prices=prices)
            known = {g.name: g for g in cfg.groups}
            for name in groups:
                if name not in known:
                    raise PlanError(f"group {name!r} of {run_dir} is not a group of {config} "
                                    f"(its groups: {', '.join(known)})")
            for name, g in known.items():
                if name not in groups:
                    raise PlanError(f"group {name!r} of {config} has no measurements in {run_dir}")
                m = groups[name]
                m.accelerator, m.price, m.max_count = g.accelerator, cfg.price_of(g), g.max_processes
                if m.replicas_from in ("assumed 1", "logs/"):
                    m.replicas, m.replicas_from = float(max(1, g.processes)), "config"
        else:
            _from_summary(groups, Path(run_dir))
            for m in groups.values():
                if m.accelerator in table:
                    m.price = table[m.accelerator]
    except ConfigError as e:
        raise PlanError(str(e)) from None
    for m in groups.values():
        if m.price is None:
            where = (f"{config}: no price_per_hour and no prices: entry for accelerator {m.accelerator!r}"
                     if config else f"{run_dir}/summary.json records no price for it")
            raise PlanError(f"group {m.name!r} has no price ({where}); give --config RUN_CONFIG with "
                            "accelerators and prices, or --prices FILE")


def _from_summary(groups: dict[str, GroupMeasure], run_dir: Path) -> None:
    """``summary.json`` ``cost.groups.<name>``: ``accelerator``, ``price_per_hour``, replicas."""
    path = run_dir / "summary.json"
    try:
        summary = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"{path}: cannot be read ({e})") from None
    recorded = (summary.get("cost") or {}).get("groups") or {}
    for name, m in groups.items():
        rec = recorded.get(name) or {}
        m.accelerator = rec.get("accelerator")
        m.price = rec.get("price_per_hour")
        n = rec.get("processes", rec.get("replicas"))
        if isinstance(n, (int, float)) and n > 0 and m.replicas_from in ("assumed 1", "logs/"):
            m.replicas, m.replicas_from = float(n), "summary.json"


@dataclasses.dataclass
class Plan:
    counts: dict[str, int]
    excluded: dict[str, str]
    useful_per_hour: float
    cost_per_hour: float
    #: groups planned on their cost alone: their mismatch was measured over too few RL steps
    unmeasured: dict[str, str] = dataclasses.field(default_factory=dict)


def make_plan(groups: dict[str, GroupMeasure], budget: float, limits: Limits,
              mins: dict[str, int] | None = None, maxs: dict[str, int] | None = None,
              min_rl_steps: int = 0) -> Plan:
    """Exclude the groups over a limit or without a measured rate, then solve exactly.

    A group whose measurements cover fewer than ``min_rl_steps`` RL steps (``--min-rl-steps``) is
    not judged against the limits: its mismatch is "unmeasured — run longer" (``Plan.unmeasured``)
    and it is planned on its cost alone (a few steps of k3 or out-of-range share say little: an
    8-step run's k3 growth of 2e3 excluded a bf16 group whose probe KL was 1e-5).

    ``mins`` (``--min``): replicas a group must have (one bf16 replica for the evaluations, say):
    bought first, the rest of the budget solved as before (``n = min + n'`` keeps the problem a
    knapsack, so the plan stays optimal under the bound). ``maxs`` (``--max``, or the config's
    ``max_processes``): at most that many."""
    mins, maxs = dict(mins or {}), dict(maxs or {})
    for name in [*mins, *maxs]:
        if name not in groups:
            raise PlanError(f"--min/--max: unknown group {name!r} (the run's groups: {', '.join(groups)})")
    excluded: dict[str, str] = {}
    unmeasured: dict[str, str] = {}
    items = []
    for name, m in groups.items():
        if m.rl_steps is not None and m.rl_steps < min_rl_steps:
            unmeasured[name] = (f"unmeasured — run longer ({m.rl_steps} of --min-rl-steps {min_rl_steps} "
                                "RL steps): planned on its cost alone")
            broken = []
        else:
            broken = check_limits(m.limit_values(), limits)
        if broken:
            excluded[name] = "; ".join(broken)
        elif math.isnan(m.useful_share) or math.isnan(m.k3):
            excluded[name] = "no trained samples in the window: useful share and mismatch unmeasured"
        elif not (m.useful_per_hour > 0):
            excluded[name] = "no useful samples per hour measured (no throughput, or useful share 0)"
        else:
            top = maxs.get(name, m.max_count)
            if top is not None and mins.get(name, 0) > top:
                raise PlanError(f"group {name!r}: --min {mins[name]} is above its maximum {top}")
            items.append(Item(name, m.useful_per_hour, float(m.price),
                              None if top is None else top - mins.get(name, 0)))
        if name in excluded and mins.get(name, 0) > 0:
            raise PlanError(f"--min {name}={mins[name]}: the group cannot be planned ({excluded[name]})")
    fixed_cost = sum(n * float(groups[g].price) for g, n in mins.items())
    if fixed_cost > budget + 1e-9:
        raise PlanError(f"--min replicas cost {fixed_cost:g} USD/h, over the budget of {budget:g}")
    counts, value, cost = solve(items, budget - fixed_cost)
    value += sum(n * groups[g].useful_per_hour for g, n in mins.items())
    return Plan({n: counts.get(n, 0) + mins.get(n, 0) for n in groups}, excluded, value, cost + fixed_cost,
                unmeasured)


def _counts(values: list[str], flag: str) -> dict[str, int]:
    out = {}
    for v in values:
        name, _, n = v.partition("=")
        if not name or not n.isdigit():
            raise PlanError(f"{flag} {v!r}: expected GROUP=N (N an integer >= 0)")
        out[name] = int(n)
    return out


def plan_document(groups: dict[str, GroupMeasure], plan: Plan, budget: float, limits: Limits,
                  run_dir: str) -> dict:
    """``plan.yaml``'s content: ``groups:`` (what merges into a config) and how it was made."""
    return {
        "groups": [{"name": n, "accelerator": m.accelerator, "processes": plan.counts[n],
                    "price_per_hour": m.price} for n, m in groups.items()],
        "budget_usd_per_hour": budget,
        "cost_usd_per_hour": round(plan.cost_per_hour, 6),
        "useful_samples_per_hour": round(plan.useful_per_hour, 3),
        "measured_from": str(run_dir),
        "limits": {"source": limits.source, "file": limits.path,
                   **{k: v for k, v in limits.values.items() if v is not None}},
        "excluded": plan.excluded,
        "unmeasured": plan.unmeasured,
        "method": "exact: branch and bound over integer replica counts (experiments.plan_solve)",
    }


def _fmt(x: float | None, spec: str = ".3g") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_plan(console, groups: dict[str, GroupMeasure], plan: Plan, budget: float, limits: Limits) -> None:
    from rich.table import Table

    table = Table(title=f"plan: {budget:g} USD/h budget")
    for col in ("group", "accel.", "USD/h", "replicas", "tok/s/rep.", "tok/sample", "useful",
                "k3", "k3/min", "k3 growth", "out-of-range", "oor added", "stale", "probe KL",
                "useful/h/rep.", "useful/USD", "planned", "why not"):
        table.add_column(col, justify="left" if col in ("group", "accelerator", "why not") else "right")
    for n, m in groups.items():
        per_usd = m.useful_per_hour / m.price if m.price else math.nan
        table.add_row(n, m.accelerator or "–", _fmt(m.price, ".2f"), f"{m.replicas:g} {m.replicas_from}",
                      _fmt(m.tokens_per_s / max(m.replicas, 1e-9), ".0f"), _fmt(m.tokens_per_sample, ".1f"),
                      _fmt(m.useful_share, ".3f"), _fmt(m.k3), _fmt(m.k3_ratio, ".2f"),
                      _fmt(m.k3_growth, ".2f"),
                      _fmt(m.out_of_range, ".4f"), _fmt(m.out_of_range_added, ".4f"),
                      _fmt(m.staleness, ".2f"), _fmt(m.probe_kl),
                      _fmt(m.useful_per_hour, ".0f"), _fmt(per_usd, ".0f"), str(plan.counts[n]),
                      plan.excluded.get(n, "") or plan.unmeasured.get(n, ""))
    console.print(table)
    if plan.unmeasured:
        console.print(f"warning: {', '.join(plan.unmeasured)} planned on cost alone: measured over fewer "
                      "RL steps than --min-rl-steps, the limits were not applied; run longer",
                      highlight=False)
    console.print(f"plan: {plan.cost_per_hour:.2f} of {budget:g} USD/h, "
                  f"{plan.useful_per_hour:,.0f} useful samples/h (at the run's measured rates; exact "
                  "branch and bound over integer replica counts)", highlight=False)
    console.print(limits.describe(), highlight=False)
    if limits.warning:
        console.print(f"limits warning: {limits.warning}", highlight=False)
    judged = [m for n, m in groups.items() if n not in plan.excluded] or list(groups.values())
    froms = sorted({m.useful_from for m in judged})
    rates = sorted({f"samples produced per {m.rate_from} x useful share (trainer_jax.cost)"
                    if m.rate_from else "tokens/s per replica / tokens per sample x useful share (realised)"
                    for m in judged})
    console.print(f"useful share from: {', '.join(froms)}; rate: {'; '.join(rates)}; measurements: "
                  f"the last {WINDOW:.0%} of the run's RL steps", highlight=False)


def plan_main(argv: list[str]) -> int:
    """``mixrl-train plan``: bad input is one line and exit 2."""
    from rich.console import Console

    p = argparse.ArgumentParser(
        prog="mixrl-train plan",
        description="Recommend a sampler pool (replicas per group) maximising useful samples per hour "
                    "within a budget and stability limits, from a run's measurements; writes plan.yaml.")
    p.add_argument("run_dir", help="a run directory (metrics.jsonl)")
    p.add_argument("--budget", type=float, required=True, help="USD per hour for the whole sampler pool")
    p.add_argument("--config", help="the run's config: its groups' accelerator / price_per_hour and prices:")
    p.add_argument("--prices", help="price table (YAML/JSON: accelerator -> USD per replica-hour)")
    p.add_argument("--limits", help="stability limits YAML, or 'writeup' for the write-up's figures "
                                    "(default: experiments/plan_limits.yaml, probe KL and out-of-range "
                                    "share: what a precision adds)")
    p.add_argument("--min-rl-steps", type=int, default=50, metavar="N",
                   help="a group measured over fewer RL steps is not judged against the limits: "
                        "'unmeasured - run longer', planned on its cost alone (default 50)")
    p.add_argument("--out", default="plan.yaml", help="where to write the plan (default plan.yaml)")
    p.add_argument("--min", action="append", default=[], metavar="GROUP=N",
                   help="at least N replicas of GROUP (e.g. bf16=1 to keep a bf16 evaluator); repeatable")
    p.add_argument("--max", action="append", default=[], metavar="GROUP=N",
                   help="at most N replicas of GROUP (over --config's max_processes); repeatable")
    args = p.parse_args(argv)
    # Off a terminal (a log, a pipe) rich would squeeze the table's 17 columns into 80.
    console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200)
    try:
        if not math.isfinite(args.budget) or args.budget < 0:  # before anything is read
            raise PlanError(f"--budget must be a finite USD per hour >= 0, got {args.budget}")
        limits = load_limits(args.limits)
        groups = read_run(args.run_dir)
        attach_prices(groups, args.run_dir, args.config, args.prices)
        if args.min_rl_steps < 0:
            raise PlanError(f"--min-rl-steps must be >= 0, got {args.min_rl_steps}")
        plan = make_plan(groups, args.budget, limits, _counts(args.min, "--min"), _counts(args.max, "--max"),
                         min_rl_steps=args.min_rl_steps)
    except PlanError as e:
        print(f"mixrl-train plan: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print_plan(console, groups, plan, args.budget, limits)
    doc = plan_document(groups, plan, args.budget, limits, args.run_dir)
    header = ("# mixrl-train plan " + " ".join(argv) + "\n# groups: merge into a run config with "
              "mixrl-train --config C --plan THIS, or mixrl-fleet up --plan THIS\n")
    try:
        Path(args.out).write_text(header + yaml.safe_dump(doc, sort_keys=False, width=100))
    except OSError as e:
        print(f"mixrl-train plan: --out {args.out}: {e}", file=sys.stderr)
        return 2
    console.print(f"wrote {args.out}", highlight=False)
    if not any(plan.counts.values()):
        console.print("[red]no replica planned[/red]: every group is over a limit or unmeasured, or the "
                      "budget buys none (see 'why not')", highlight=False)
        return 1
    return 0
