"""Issue 48's decision table and comparisons on a synthetic grid with a known answer."""

import math
from pathlib import Path

from experiments.report.decide import comparisons, decision_section, decision_table, outcomes
from experiments.report.grid import Grid
from experiments.report.runs import RunResult


def _run(pool, cond, seed, final, collapse=None, ok=True):
    return RunResult(pool, cond, seed, Path("/nonexistent"), ok, steps=300, eval_start=0.22,
                     eval_final=final, collapse_step=collapse)


def _grid(results):
    return Grid.of(results, {"grpo": "GRPO", "sc_mis": "SC + MIS"}, {})


def test_a_separated_cell_is_reported_and_an_overlapping_one_is_not():
    rs = []
    for s in range(6):
        rs.append(_run("homogeneous", "grpo", s, 0.60 + 0.01 * s))
        rs.append(_run("homogeneous", "sc_mis", s, 0.60 + 0.01 * s))
        rs.append(_run("mixed", "grpo", s, 0.05, collapse=100 + s))  # collapses every seed
        rs.append(_run("mixed", "sc_mis", s, 0.58 + 0.01 * s, collapse=200 if s == 0 else None))
    rs.append(_run("mixed", "sc_mis", 6, math.nan, ok=False))  # a failed run counts nowhere
    grid = _grid(rs)
    cells = outcomes(grid)
    assert cells[("mixed", "sc_mis")].n == 6 and cells[("mixed", "sc_mis")].collapses == 1
    lines = comparisons(grid)
    mixed_grpo = next(ln for ln in lines if ln.startswith("mixed vs homogeneous, GRPO"))
    assert "homogeneous/grpo higher" in mixed_grpo and "mixed/grpo higher" in mixed_grpo  # pass and collapse
    mixed_sc = next(ln for ln in lines if ln.startswith("mixed vs homogeneous, SC + MIS"))
    assert mixed_sc.count("not distinguishable at n = 6 / 6") == 2
    within = next(ln for ln in lines if ln.startswith("mixed, SC + MIS vs GRPO"))
    assert "mixed/sc_mis higher" in within and "mixed/grpo higher" in within
    table = decision_table(grid)
    assert any(row.startswith("| mixed | GRPO | 6 | 0.050 [0.050, 0.050] | 6 / 6, 1.00 [0.61, 1.00] |")
               for row in table), table


def test_no_section_without_two_seeds_in_some_cell():
    assert decision_section(_grid([_run("mixed", "grpo", 0, 0.5), _run("homogeneous", "grpo", 0, 0.5)])) == []
    two = _grid([_run("mixed", "grpo", s, 0.5) for s in (0, 1)])
    assert decision_section(two)[0].startswith("## Decision table")
