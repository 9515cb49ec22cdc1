"""Issue 48's rule as the seed's claims apply it (``seed_claims.judge`` / ``_above`` / ``rate_text``):
reproduced only where the 95 % intervals are disjoint in the claim's direction, at 3 runs a side and
more; touching intervals overlap."""

import math

import pytest

from experiments.report.intervals import MIN_SEEDS, wilson_interval
from experiments.report.seed_claims import NOT_REPRODUCED, REPRODUCED, _above, judge, rate_text

LOW, HIGH = (0.0, 0.4), (0.5, 1.0)


def test_judge_reads_disjoint_intervals_in_the_claims_direction():
    assert judge(HIGH, LOW, True, 3, 3) == REPRODUCED  # the claim: a above b, and it is
    assert judge(HIGH, LOW, False, 3, 3) == NOT_REPRODUCED  # the claim: a below b; it lies above
    assert judge(LOW, HIGH, False, 3, 3) == REPRODUCED
    assert judge(LOW, HIGH, True, 3, 3) == NOT_REPRODUCED
    # Disjoint by a hair either way.
    assert judge((0.5 + 1e-9, 1.0), (0.0, 0.5), True, 6, 6) == REPRODUCED
    assert judge((0.0, 0.5), (0.5 + 1e-9, 1.0), True, 6, 6) == NOT_REPRODUCED


def test_judge_overlap_and_touching_are_not_distinguishable():
    # Intervals sharing one point overlap (closed intervals): no verdict either way.
    assert judge((0.5, 1.0), (0.0, 0.5), True, 3, 4) == "not distinguishable at n = 3 / 4"
    assert judge((0.0, 0.5), (0.5, 1.0), True, 4, 3) == "not distinguishable at n = 4 / 3"
    # One inside the other.
    assert judge((0.2, 0.8), (0.3, 0.4), False, 5, 5) == "not distinguishable at n = 5 / 5"
    # A missing interval (a cell without the outcome) separates nothing.
    assert judge((math.nan, math.nan), LOW, True, 3, 3) == "not distinguishable at n = 3 / 3"


def test_judge_needs_three_runs_a_side():
    assert MIN_SEEDS == 3
    # However far apart: 2 runs on either side decide nothing.
    for na, nb in ((2, 3), (3, 2), (2, 2), (0, 6)):
        expected = f"not assessable at n = {na} / {nb} (a verdict needs 3 runs a side)"
        assert judge(HIGH, LOW, True, na, nb) == expected
    assert judge(HIGH, LOW, True, 3, 3) == REPRODUCED


def test_judge_on_collapse_rates():
    """Where the thresholds fall for the counts a grid gives: all against none separates from 4
    seeds a cell (Wilson), not at 3 (3 / 3 [0.44, 1] and 0 / 3 [0, 0.56] overlap), nor at 2."""
    def rates(k, n, j, m):
        return judge(wilson_interval(k, n), wilson_interval(j, m), True, n, m)

    assert rates(2, 2, 0, 2) == "not assessable at n = 2 / 2 (a verdict needs 3 runs a side)"
    assert rates(3, 3, 0, 3) == "not distinguishable at n = 3 / 3"
    assert rates(4, 4, 0, 4) == REPRODUCED
    assert rates(0, 4, 4, 4) == NOT_REPRODUCED
    # Half against none: [0.19, 0.81] vs [0, 0.39].
    assert rates(3, 6, 0, 6) == "not distinguishable at n = 6 / 6"
    assert rates(6, 6, 0, 6) == REPRODUCED


@pytest.mark.parametrize("lo,hi,n,verdict", [
    (1.6, 2.4, 3, REPRODUCED),  # entirely above 1.5x
    (0.8, 1.4, 3, NOT_REPRODUCED),  # entirely below
    (1.2, 1.9, 6, "not distinguishable from 1.5x at n = 6"),  # straddling
    (1.5, 2.4, 3, "not distinguishable from 1.5x at n = 3"),  # touching from above
    (0.8, 1.5, 3, "not distinguishable from 1.5x at n = 3"),  # touching from below
    (math.nan, math.nan, 4, "not distinguishable from 1.5x at n = 4"),  # no interval
    (1.6, 2.4, 2, "not assessable at n = 2 (a verdict needs 3 runs)"),  # above, but 2 runs
    (0.8, 1.4, 0, "not assessable at n = 0 (a verdict needs 3 runs)"),
])
def test_above_a_threshold(lo, hi, n, verdict):
    assert _above(lo, hi, 1.5, n) == verdict


def _wilson_by_hand(k: int, n: int) -> tuple[float, float]:
    """The textbook closed form, z = 1.96 (the 97.5 % normal quantile to 2 decimals, as tables give it)."""
    z, p = 1.96, k / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)


def test_rate_text_carries_the_wilson_interval():
    # Published values: 0 of 6 -> [0, 0.390], 6 of 6 -> [0.610, 1].
    assert rate_text(0, 6) == "0 / 6 = 0.00 [0.00, 0.39]"
    assert rate_text(6, 6) == "6 / 6 = 1.00 [0.61, 1.00]"
    assert wilson_interval(0, 6)[1] == pytest.approx(0.390, abs=5e-4)
    assert wilson_interval(6, 6)[0] == pytest.approx(0.610, abs=5e-4)
    for k, n in ((2, 6), (1, 2), (5, 13), (4, 20)):
        lo, hi = _wilson_by_hand(k, n)
        assert wilson_interval(k, n) == pytest.approx((lo, hi), abs=1e-4)
        assert rate_text(k, n) == f"{k} / {n} = {k / n:.2f} [{lo:.2f}, {hi:.2f}]"
    assert rate_text(2, 6) == "2 / 6 = 0.33 [0.10, 0.70]"
    assert rate_text(0, 0) == "0 / 0"  # no runs: no rate, no interval
