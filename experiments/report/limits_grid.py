"""The planner's default limits, measured by issue 48's grid (issue 48, item 5).

    python -m experiments.report.limits_grid configs/ablation_decide.yaml docs/results_decide \\
        --out experiments/plan_limits.yaml

For each corrected condition of the grid (every condition but the uncorrected ``grpo``) and each
pool but the control, decides with ``decide.py``'s rule whether the pool's cell stayed
indistinguishable from the homogeneous control's cell under the same condition: both cells with at
least ``intervals.MIN_SEEDS`` seeds, and their final held-out pass@1 intervals overlapping AND their
collapse-rate intervals overlapping. Each cell's mismatch is measured as ``mixrl-train plan``
measures a run (``experiments.plan.read_run``: per group, the mean over the last half of the run's
RL steps), then per group averaged over the cell's finished runs; the evaluation-only group (the
config's ``eval_only`` group or ``train.eval_group``, or a group that trained no sample) is left out:
it trains nothing, so neither its probe KL nor its out-of-range share says anything about training.
A cell's figures are its worst training group's mean probe KL, and the largest out-of-range share a
training group ADDS over the cell's lowest-probe-KL training group (``plan._out_of_range_added``,
the planner's rule, applied to the per-group means).

The limits file gets, for ``--condition`` (default ``sc_mis``, the seed's correction),
``max_probe_kl`` / ``max_out_of_range_added`` = the largest such figures among the control and the
pools that stayed indistinguishable (the control alone when none did, and the file says so). Every
pool's verdict and figures are kept under ``runs:`` (the other corrected conditions' too, for
comparison), the distinguishable ones included: the true threshold lies between.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import sys
from pathlib import Path

import yaml

from experiments.plan import GroupMeasure, _out_of_range_added, read_run
from experiments.report.decide import CONTROL_POOL, UNCORRECTED, outcomes
from experiments.report.grid import Grid
from experiments.report.intervals import MIN_SEEDS, CellOutcome, compare, overlap
from experiments.report.runs import RunResult, _cell_config, collect, nanmean, run_metrics

DEFAULT_CONDITION = "sc_mis"
PROG = "python -m experiments.report.limits_grid"
WARNING = ("measured on the demo's tiny CPU model (configs/local_mixed.yaml: single-digit arithmetic, "
           "300 asynchronous steps from one warm start; the samplers' formats emulated on a CPU), not "
           "on a real model or accelerator: a limit says where SC + MIS kept this testbed training like "
           "the homogeneous control, and little about FP8 / NVFP4 at scale; the write-up's figures are "
           "--limits writeup")
HEADER = """\
# The planner's default stability limits (mixrl-train plan without --limits), measured by issue 48's
# grid. Generated; do not edit by hand. Regenerate after the grid's archive changes:
#   {command}
# (experiments/report/limits_grid.py; tests/experiments/test_limits_grid.py fails while this file
# differs from what that command writes.) Only what a precision adds is bounded: the version probe's
# KL (the sampler's log-probs of fixed tokens against the trainer's, same version: no staleness) and
# the out-of-range share a group ADDS over the run's lowest-probe-KL group (the stale samples' drift,
# which every group of a run shares, cancels). Each limit is the largest value at which condition
# {condition} (the default, sc_mis, is SC + MIS: the seed's correction) stayed indistinguishable from
# the homogeneous control (decide.py's rule); the pools that did not are listed under runs:, since
# the true threshold lies between. The write-up's figures stay a named alternative: --limits writeup
# (experiments/plan_limits_writeup.yaml).
"""


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """A cell's per-group mismatch: each training group's mean over the cell's runs."""

    probe_kl: dict[str, float]
    added: dict[str, float]
    #: the training group with the lowest mean probe KL (None: fewer than two groups probed)
    reference: str | None
    #: the groups left out as evaluation-only, over all the cell's runs
    eval_only: tuple[str, ...]

    @staticmethod
    def _worst(values: dict[str, float]) -> tuple[str | None, float]:
        known = {g: v for g, v in values.items() if not math.isnan(v)}
        if not known:
            return None, math.nan
        g = max(known, key=lambda k: known[k])
        return g, known[g]

    @property
    def worst_probe_kl(self) -> tuple[str | None, float]:
        """The training group with the largest mean probe KL, and that KL."""
        return self._worst(self.probe_kl)

    @property
    def worst_added(self) -> tuple[str | None, float]:
        """The training group adding the most out-of-range share, and that share."""
        return self._worst(self.added)


def run_measures(run: RunResult) -> dict[str, GroupMeasure]:
    """``mixrl-train plan``'s per-group measurements of one run, archived (gzipped metrics) or not."""
    return read_run(run.run_dir, records=run_metrics(run.run_dir))


def eval_only_groups(run: RunResult, measures: dict[str, GroupMeasure]) -> set[str]:
    """The run's groups that train nothing: the config's ``eval_only`` groups and
    ``train.eval_group`` (from ``cell.json``'s command), and any group without a trained sample."""
    cell_json = Path(run.run_dir) / "cell.json"
    cfg = _cell_config(json.loads(cell_json.read_text())) if cell_json.exists() else None
    off = set()
    if cfg is not None:
        off = {g.name for g in cfg.groups if g.eval_only} | {cfg.train.eval_group}
    return (off | {g for g, m in measures.items() if not m.tokens_per_sample > 0}) & set(measures)


def cell_mismatch(runs: list[RunResult]) -> Mismatch:
    """Per training group, the mean over ``runs`` of each run's probe KL and out-of-range share; the
    added share from those means by the planner's rule (over the lowest-probe-KL group, at least 0)."""
    per_run, left_out = [], set()
    for run in runs:
        measures = run_measures(run)
        off = eval_only_groups(run, measures)
        left_out |= off
        per_run.append({g: m for g, m in measures.items() if g not in off})
    pooled: dict[str, GroupMeasure] = {}
    for g in sorted({g for m in per_run for g in m} - left_out):
        ms = [m[g] for m in per_run if g in m]
        pooled[g] = dataclasses.replace(ms[0], probe_kl=nanmean([m.probe_kl for m in ms]),
                                        out_of_range=nanmean([m.out_of_range for m in ms]),
                                        out_of_range_added=math.nan)
    _out_of_range_added(pooled)
    probed = [g for g, m in pooled.items() if not (math.isnan(m.probe_kl) or math.isnan(m.out_of_range))]
    reference = min(probed, key=lambda g: pooled[g].probe_kl) if len(probed) >= 2 else None
    return Mismatch({g: m.probe_kl for g, m in pooled.items()},
                    {g: m.out_of_range_added for g, m in pooled.items()}, reference, tuple(sorted(left_out)))


def verdict(here: CellOutcome, control: CellOutcome) -> str:
    """decide.py's rule: ``within`` where both outcomes' intervals overlap the control's, ``not
    within`` where either pair is disjoint, ``not assessable`` below ``MIN_SEEDS`` seeds a cell."""
    if here.n < MIN_SEEDS or control.n < MIN_SEEDS:
        return "not assessable"
    same = overlap(here.pass_interval, control.pass_interval) and overlap(
        here.collapse_interval, control.collapse_interval)
    return "within" if same else "not within"


@dataclasses.dataclass(frozen=True)
class PoolRow:
    """One pool's cell under one condition: its verdict against the control and its mismatch."""

    pool: str
    n: int
    verdict: str  # "control", "within", "not within", "not assessable"
    why: str
    mismatch: Mismatch

    def line(self) -> str:
        g_kl, kl = self.mismatch.worst_probe_kl
        g_oor, oor = self.mismatch.worst_added
        ref = self.mismatch.reference
        oor_text = (f"out-of-range added {oor:.4f} ({g_oor} over {ref})" if ref and g_oor
                    else "out-of-range added unmeasured")
        kl_text = f"probe KL {kl:.3g} ({g_kl})" if g_kl else "probe KL unmeasured"
        off = self.mismatch.eval_only
        left = f"; left out as evaluation-only: {', '.join(off)}" if off else ""
        return f"{self.pool} (n = {self.n}): {kl_text}, {oor_text}{left}; {self.why}"


def condition_rows(grid: Grid, cells: dict[tuple[str, str], CellOutcome], cond: str,
                   pools: list[str], control: str = CONTROL_POOL) -> list[PoolRow]:
    """Every pool with a finished run under ``cond``, the control first."""
    if not grid.runs(control, cond):
        raise ValueError(f"no finished run of the control cell {control}/{cond}")
    base = cells[(control, cond)]
    rows = []
    for pool in [control, *[p for p in pools if p != control]]:
        runs = grid.runs(pool, cond)
        if not runs:
            continue
        here = cells[(pool, cond)]
        if pool == control:
            v, why = "control", "the control"
        else:
            v = verdict(here, base)
            why = f"{compare(here, base, 'pass')}; {compare(here, base, 'collapse')}"
        rows.append(PoolRow(pool, here.n, v, why, cell_mismatch(runs)))
    return rows


def limits_of(rows: list[PoolRow]) -> dict[str, tuple[float | None, str]]:
    """``max_probe_kl`` / ``max_out_of_range_added``: the largest worst-group figure among the control
    and the pools within, with where it came from (``pool/group``)."""
    kept = [r for r in rows if r.verdict in ("control", "within")]
    out = {}
    for key, attr in (("max_probe_kl", "worst_probe_kl"), ("max_out_of_range_added", "worst_added")):
        found = [(getattr(r.mismatch, attr), r.pool) for r in kept]
        found = [((g, v), p) for (g, v), p in found if g is not None]
        if not found:
            out[key] = (None, "unmeasured")
            continue
        (g, v), p = max(found, key=lambda x: x[0][1])
        out[key] = (v, f"{p}/{g}")
    return out


def limits_document(sweep: str, archive: str, date: str, condition: str = DEFAULT_CONDITION) -> dict:
    """The limits file's content from the grid ``sweep`` (its config) archived under ``archive``."""
    from experiments.sweep import load_sweep

    spec = load_sweep(sweep)
    results = collect(archive)
    if not results:
        raise ValueError(f"{archive}: no archived cell (pool/condition/seedN)")
    grid = Grid.of(results, spec.labels(), {})
    pools = [p for p in spec.pools if p in grid.pools] + [p for p in grid.pools if p not in spec.pools]
    corrected = [c for c in grid.conds if c != UNCORRECTED]
    if condition not in corrected:
        raise ValueError(f"{archive}: no finished cell of condition {condition!r} "
                         f"(corrected conditions found: {', '.join(corrected) or 'none'})")
    cells = outcomes(grid)
    planned = len(spec.seeds)
    runs: dict[str, dict] = {}
    chosen = None
    for cond in [condition, *[c for c in corrected if c != condition]]:
        rows = condition_rows(grid, cells, cond, pools)
        chosen = chosen or rows
        title = f"{cond} ({grid.label(cond)})" + (", the limits follow it" if cond == condition
                                                  else ", for comparison only")
        entry: dict = {}
        for key, name in (("control", "control"), ("within", "within"), ("not within", "not_within"),
                          ("not assessable", "not_assessable")):
            lines = [r.line() for r in rows if r.verdict == key]
            if lines:
                entry[name] = lines[0] if key == "control" else lines
        entry["limits"] = ", ".join(f"{k} {_fmt(v)} ({w})" for k, (v, w) in limits_of(rows).items())
        runs[title] = entry
    runs["n per cell"] = ", ".join(f"{p}/{c} {cells[(p, c)].n}" for p in pools for c in grid.conds
                                   if cells[(p, c)].n) + f" (of {planned} seeds planned)"
    lims = limits_of(chosen)
    within = [r.pool for r in chosen if r.verdict == "within"]
    label = grid.label(condition)
    n_text = ", ".join(f"{r.pool} {r.n}" for r in chosen)
    basis = (f"pools within the control: {', '.join(within)}" if within else
             f"no pool stayed indistinguishable from the control under {label}: the control's own figures")
    source = (f"issue 48's grid ({sweep}, archive {archive}, {date}): the largest probe KL and "
              f"out-of-range share added at which {label} stayed indistinguishable from the "
              f"{CONTROL_POOL} control (decide.py: final held-out pass@1 and collapse-rate 95 % "
              f"intervals overlapping); n per {label} cell: {n_text} of {planned}; {basis}; "
              + "; ".join(f"{k} from {w}" for k, (_, w) in lims.items()))
    notes = (f"The default follows {label} ({condition}), the seed's correction; the other corrected "
             "conditions' figures are under runs: for comparison. A cell's figures: its worst training "
             "group's probe KL and largest added out-of-range share, each the mean over the cell's runs "
             "of mixrl-train plan's measure (the last half of a run's RL steps); the evaluation-only "
             "group is left out. The k3 keys and the absolute out-of-range share are not bounded: they "
             "include the stale samples' drift.")
    return {"source": source, "warning": WARNING, "generated_by": None,
            **{key: None if value is None else float(f"{value:.4g}") for key, (value, _) in lims.items()},
            "runs": runs, "notes": notes}


def _fmt(v: float | None) -> str:
    return "null" if v is None else f"{v:.4g}"


class _Folded(yaml.SafeDumper):
    """Long strings as folded blocks (``>-``): the file is read by people as much as by the planner."""


_Folded.add_representer(str, lambda d, s: d.represent_scalar(
    "tag:yaml.org,2002:str", s, style=">" if len(s) > 80 and "\n" not in s else None))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep", nargs="?", default="configs/ablation_decide.yaml", help="the grid's sweep file")
    ap.add_argument("archive", nargs="?", default="docs/results_decide",
                    help="its archive (report.archive) or run directory")
    ap.add_argument("--out", default="experiments/plan_limits.yaml")
    ap.add_argument("--condition", default=DEFAULT_CONDITION, help="the condition the limits follow")
    ap.add_argument("--date", default=datetime.date.today().isoformat(),
                    help="the date the source: names (default today)")
    return ap


def render(args: argparse.Namespace) -> tuple[str, dict]:
    """The limits file's text for parsed arguments, and its content."""
    regenerate = f"{PROG} {args.sweep} {args.archive} --out {args.out}"
    if args.condition != DEFAULT_CONDITION:
        regenerate += f" --condition {args.condition}"
    doc = limits_document(args.sweep, args.archive, args.date, args.condition)
    doc["generated_by"] = f"{regenerate} --date {args.date}"
    body = yaml.dump(doc, Dumper=_Folded, sort_keys=False, width=100, allow_unicode=True)
    return HEADER.format(command=regenerate, condition=args.condition) + body, doc


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        text, doc = render(args)
    except (OSError, ValueError) as e:  # SweepError is a ValueError
        print(f"{PROG}: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}: max_probe_kl {_fmt(doc['max_probe_kl'])}, max_out_of_range_added "
          f"{_fmt(doc['max_out_of_range_added'])}")
    for title, entry in doc["runs"].items():
        print(f"{title}: {entry if isinstance(entry, str) else entry['limits']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
