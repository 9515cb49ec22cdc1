"""Per-cell outcomes with intervals, and the pre-registered rule that compares two cells.

A cell (pool x condition) is summarised by two numbers over its seeds (issue 48's decision rules):

- final held-out pass@1: the mean over seeds with a 95 % percentile-bootstrap interval (resampling
  the seeds with replacement; a fixed generator seed, so the document regenerates identically);
- collapse rate: collapsed seeds / finished seeds with a 95 % Wilson score interval (sensible at
  0 / n and n / n, where the normal approximation collapses to a point).

Two cells differ ("reproduced") only where their intervals on that outcome do not overlap;
otherwise the honest reading is "not distinguishable at n = a / b". Non-overlap of two 95 %
intervals is a conservative test (it roughly corresponds to p < 0.01 for similar widths): with
6 seeds a cell-to-cell difference must be large to count, which is the point — seed noise alone
produced 2/2 vs 0/2 splits in earlier grids.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

LEVEL = 0.95
BOOTSTRAP_DRAWS = 10_000
BOOTSTRAP_SEED = 48
#: Fewer seeds than this in either cell and no verdict is given: the bootstrap interval of one seed
#: is a point, of two the pair's span, so they would "separate" on seed noise alone.
MIN_SEEDS = 3


def bootstrap_mean_interval(values: Sequence[float], level: float = LEVEL, draws: int = BOOTSTRAP_DRAWS,
                            seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """Percentile-bootstrap interval of the mean of ``values`` (NaNs dropped; (nan, nan) if none).

    One value gives a zero-width interval at it: a single seed carries no spread to resample.
    """
    x = np.asarray([v for v in values if v is not None and not math.isnan(v)], dtype=np.float64)
    if x.size == 0:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(draws, x.size))].mean(axis=1)
    tail = (1.0 - level) / 2
    lo, hi = np.quantile(means, [tail, 1.0 - tail])
    return float(lo), float(hi)


def wilson_interval(successes: int, n: int, level: float = LEVEL) -> tuple[float, float]:
    """Wilson score interval of a proportion ``successes / n`` ((nan, nan) when n is 0)."""
    if n <= 0:
        return math.nan, math.nan
    if not 0 <= successes <= n:
        raise ValueError(f"wilson_interval: {successes} successes of {n}")
    from statistics import NormalDist

    z = NormalDist().inv_cdf(0.5 + level / 2)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # Clamp the rounding at the ends: 0 / n has its lower bound at exactly 0.
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclasses.dataclass(frozen=True)
class CellOutcome:
    """One cell's outcome over its finished seeds."""

    pool: str
    condition: str
    n: int
    pass_mean: float
    pass_interval: tuple[float, float]
    collapses: int
    collapse_interval: tuple[float, float]

    @property
    def collapse_rate(self) -> float:
        return self.collapses / self.n if self.n else math.nan


def cell_outcome(pool: str, condition: str, finals: Sequence[float],
                 collapsed: Sequence[bool]) -> CellOutcome:
    """The outcome of a cell from each finished seed's final pass@1 and whether it collapsed."""
    if len(finals) != len(collapsed):
        raise ValueError(f"cell {pool}/{condition}: {len(finals)} pass@1 values for {len(collapsed)} runs")
    n = len(collapsed)
    kept = [f for f in finals if f is not None and not math.isnan(f)]
    mean = float(np.mean(kept)) if kept else math.nan
    k = sum(bool(c) for c in collapsed)
    return CellOutcome(pool, condition, n, mean, bootstrap_mean_interval(kept), k, wilson_interval(k, n))


def overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether two closed intervals share a point (an interval with a NaN overlaps everything:
    a missing interval can separate nothing)."""
    if any(math.isnan(v) for v in (*a, *b)):
        return True
    return a[0] <= b[1] and b[0] <= a[1]


def compare(a: CellOutcome, b: CellOutcome, outcome: str) -> str:
    """The pre-registered verdict on ``outcome`` (``pass`` or ``collapse``) between two cells:
    which is higher when their intervals are disjoint, else "not distinguishable at n = ...".
    """
    if outcome == "pass":
        ia, ib, va, vb, what = a.pass_interval, b.pass_interval, a.pass_mean, b.pass_mean, "final pass@1"
    elif outcome == "collapse":
        ia, ib, va, vb = a.collapse_interval, b.collapse_interval, a.collapse_rate, b.collapse_rate
        what = "collapse rate"
    else:
        raise ValueError(f"compare: outcome must be 'pass' or 'collapse', got {outcome!r}")
    if a.n < MIN_SEEDS or b.n < MIN_SEEDS:
        return f"{what}: not assessable at n = {a.n} / {b.n} (a verdict needs {MIN_SEEDS} seeds a cell)"
    if overlap(ia, ib):
        return f"{what}: not distinguishable at n = {a.n} / {b.n}"
    hi, lo = (a, b) if va > vb else (b, a)
    return (f"{what}: {hi.pool}/{hi.condition} higher than {lo.pool}/{lo.condition} "
            f"(intervals disjoint, n = {a.n} / {b.n})")


def format_interval(mean: float, interval: tuple[float, float], digits: int = 3) -> str:
    """``0.612 [0.570, 0.650]`` (``n/a`` for a NaN mean)."""
    if math.isnan(mean):
        return "n/a"
    lo, hi = interval
    return f"{mean:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"
