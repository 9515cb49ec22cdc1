"""Issue 48's decision table: every cell's outcome with its interval, and the pre-registered comparisons.

The grid's question is whether correction lets a mixed fleet train like a homogeneous one. The
rules are fixed before the runs (the sweep file states them; ``intervals.py`` implements them):

- outcome per cell = final held-out pass@1 (mean over seeds, 95 % bootstrap interval) and collapse
  rate (Wilson 95 % interval) — a run's collapse as ``RunResult.collapsed`` (reward or held-out);
- each pool is compared with the control pool under the same condition, and within each pool each
  condition with the uncorrected one; a difference is reported only where the two intervals are
  disjoint, else "not distinguishable at n = a / b".
"""

from __future__ import annotations

from experiments.report.grid import Grid
from experiments.report.intervals import CellOutcome, cell_outcome, compare, format_interval

CONTROL_POOL = "homogeneous"
UNCORRECTED = "grpo"


def outcomes(grid: Grid) -> dict[tuple[str, str], CellOutcome]:
    """Every cell's outcome over its finished runs."""
    result = {}
    for p in grid.pools:
        for c in grid.conds:
            runs = grid.runs(p, c)
            result[(p, c)] = cell_outcome(p, c, [r.eval_final for r in runs], [r.collapsed for r in runs])
    return result


def decision_table(grid: Grid) -> list[str]:
    """Markdown: pool x condition with n, final pass@1 [95 % CI] and collapses k/n [Wilson 95 % CI]."""
    cells = outcomes(grid)
    lines = ["| pool | condition | n | final held-out pass@1 (mean [95 % bootstrap CI]) | "
             "collapsed (k / n, rate [95 % Wilson CI]) |", "|---|---|---|---|---|"]
    for (pool, cond), o in cells.items():
        if o.n == 0:
            continue
        lo, hi = o.collapse_interval
        passed = format_interval(o.pass_mean, o.pass_interval)
        lines.append(f"| {pool} | {grid.label(cond)} | {o.n} | {passed} | "
                     f"{o.collapses} / {o.n}, {o.collapse_rate:.2f} [{lo:.2f}, {hi:.2f}] |")
    return lines


def comparisons(grid: Grid, control: str = CONTROL_POOL, uncorrected: str = UNCORRECTED) -> list[str]:
    """The pre-registered comparisons, one line each: every pool against ``control`` under the same
    condition, and within every pool every condition against ``uncorrected``."""
    cells = outcomes(grid)
    lines = []
    for pool in grid.pools:
        for cond in grid.conds:
            here = cells[(pool, cond)]
            if pool != control and (control, cond) in cells and here.n:
                base = cells[(control, cond)]
                lines.append(f"{pool} vs {control}, {grid.label(cond)}: {compare(here, base, 'pass')}; "
                             f"{compare(here, base, 'collapse')}")
            if cond != uncorrected and (pool, uncorrected) in cells and here.n:
                base = cells[(pool, uncorrected)]
                lines.append(f"{pool}, {grid.label(cond)} vs {grid.label(uncorrected)}: "
                             f"{compare(here, base, 'pass')}; {compare(here, base, 'collapse')}")
    return lines


def decision_section(grid: Grid) -> list[str]:
    """The section of docs/results.md that answers issue 48 (empty when no cell has two seeds)."""
    if not any(o.n >= 2 for o in outcomes(grid).values()):
        return []
    return ["## Decision table (issue 48's pre-registered rules)", "",
            "A difference counts only where the two cells' 95 % intervals are disjoint "
            "(`experiments/report/intervals.py`).", "", *decision_table(grid), "",
            *[f"- {line}" for line in comparisons(grid)], ""]
