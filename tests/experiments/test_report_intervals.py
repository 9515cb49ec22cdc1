"""The grid's per-cell intervals and the rule that compares two cells, against independent references."""

import itertools
import math

import numpy as np
import pytest

from experiments.report.intervals import (
    bootstrap_mean_interval,
    cell_outcome,
    compare,
    format_interval,
    overlap,
    wilson_interval,
)


def _wilson_by_bisection(k: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """The Wilson bounds as the two roots of |k/n - p| = z sqrt(p (1 - p) / n), found by bisection."""
    phat = k / n

    def gap(p):
        return abs(phat - p) - z * math.sqrt(p * (1 - p) / n)

    def root(a, b):  # gap(a) <= 0 < gap(b) or the reverse
        for _ in range(200):
            m = (a + b) / 2
            if (gap(m) > 0) == (gap(b) > 0):
                b = m
            else:
                a = m
        return (a + b) / 2

    lo = 0.0 if k == 0 else root(phat, 0.0)
    hi = 1.0 if k == n else root(phat, 1.0)
    return lo, hi


@pytest.mark.parametrize("k,n", [(0, 6), (1, 6), (3, 6), (5, 6), (6, 6), (0, 1), (1, 1), (2, 12), (7, 40)])
def test_wilson_matches_the_roots_of_its_defining_equation(k, n):
    lo, hi = wilson_interval(k, n)
    rlo, rhi = _wilson_by_bisection(k, n)
    assert lo == pytest.approx(rlo, abs=1e-9) and hi == pytest.approx(rhi, abs=1e-9)
    assert 0.0 <= lo <= k / n <= hi <= 1.0


def test_wilson_edges_and_errors():
    assert wilson_interval(0, 6)[0] == 0.0 and wilson_interval(6, 6)[1] == 1.0
    assert wilson_interval(0, 6)[1] == pytest.approx(0.3903, abs=1e-4)  # the textbook 0-of-6 bound
    assert all(math.isnan(v) for v in wilson_interval(0, 0))
    with pytest.raises(ValueError):
        wilson_interval(7, 6)


def _exact_bootstrap_quantiles(values, level=0.95):
    """Every ordered resample of ``values`` (n^n, equally likely): the exact percentile interval."""
    n = len(values)
    means = np.sort([np.mean(c) for c in itertools.product(values, repeat=n)])
    tail = (1 - level) / 2
    return float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))


@pytest.mark.parametrize("values", [[0.1, 0.4, 0.45, 0.9], [0.5, 0.52, 0.61, 0.58, 0.2]])
def test_bootstrap_interval_converges_to_the_exact_bootstrap(values):
    lo, hi = bootstrap_mean_interval(values, draws=200_000)
    elo, ehi = _exact_bootstrap_quantiles(values)
    assert lo == pytest.approx(elo, abs=0.01) and hi == pytest.approx(ehi, abs=0.01)


def test_bootstrap_interval_edges():
    assert bootstrap_mean_interval([0.3]) == (0.3, 0.3)
    assert all(math.isnan(v) for v in bootstrap_mean_interval([]))
    assert bootstrap_mean_interval([0.2, math.nan, 0.2]) == (0.2, 0.2)  # NaNs dropped, not propagated
    assert bootstrap_mean_interval([0.1, 0.9]) == bootstrap_mean_interval([0.1, 0.9])  # reproducible


def test_cell_outcome_counts_and_means():
    c = cell_outcome("mixed", "grpo", [0.5, 0.6, math.nan, 0.7], [False, True, True, False])
    assert c.n == 4 and c.collapses == 2 and c.collapse_rate == 0.5
    assert c.pass_mean == pytest.approx(0.6)  # the NaN (a run without a final evaluation) is left out
    assert c.collapse_interval == wilson_interval(2, 4)
    with pytest.raises(ValueError):
        cell_outcome("mixed", "grpo", [0.5], [False, True])


def test_overlap_is_closed_and_nan_separates_nothing():
    assert overlap((0.0, 0.5), (0.5, 1.0))  # touching intervals overlap
    assert not overlap((0.0, 0.49), (0.5, 1.0))
    assert overlap((0.0, 0.1), (math.nan, math.nan))


def test_compare_reports_a_difference_only_when_intervals_are_disjoint():
    never = cell_outcome("homogeneous", "grpo", [0.6] * 6, [False] * 6)
    always = cell_outcome("mixed", "grpo", [0.1] * 6, [True] * 6)
    half = cell_outcome("mixed", "sc_mis", [0.6, 0.1] * 3, [False, True] * 3)
    verdict = compare(never, always, "collapse")
    assert "mixed/grpo higher" in verdict and "n = 6 / 6" in verdict
    assert compare(never, half, "collapse") == "collapse rate: not distinguishable at n = 6 / 6"
    assert "homogeneous/grpo higher" in compare(never, always, "pass")
    # Half the seeds at 0.1: the mean's interval [0.18, 0.52] lies below 0.6, a real difference.
    assert "homogeneous/grpo higher" in compare(half, never, "pass")
    close = cell_outcome("mixed", "sc_mis", [0.5, 0.7, 0.55, 0.65, 0.6, 0.62], [False] * 6)
    assert compare(close, never, "pass") == "final pass@1: not distinguishable at n = 6 / 6"
    two = cell_outcome("mixed", "grpo", [0.1, 0.1], [True, True])
    none2 = cell_outcome("homogeneous", "grpo", [0.6, 0.6], [False, False])
    # 2/2 vs 0/2: the split two seeds gave with identical objectives decides nothing, and one or two
    # seeds' zero-width bootstrap intervals must not "separate" either.
    assert compare(two, none2, "collapse").startswith("collapse rate: not assessable at n = 2 / 2")
    assert compare(two, none2, "pass").startswith("final pass@1: not assessable at n = 2 / 2")
    three = cell_outcome("mixed", "grpo", [0.1] * 3, [True] * 3)
    three_ok = cell_outcome("homogeneous", "grpo", [0.6] * 3, [False] * 3)
    assert compare(three, three_ok, "collapse") == "collapse rate: not distinguishable at n = 3 / 3"
    assert "homogeneous/grpo higher" in compare(three, three_ok, "pass")
    empty = cell_outcome("dial", "grpo", [], [])
    assert "not assessable" in compare(empty, never, "pass")
    with pytest.raises(ValueError):
        compare(never, always, "reward")


def test_format_interval():
    assert format_interval(0.6123, (0.57, 0.65)) == "0.612 [0.570, 0.650]"
    assert format_interval(math.nan, (math.nan, math.nan)) == "n/a"
