"""Growth of the sampler/trainer mismatch over training: the slope of log k3 per RL step.

The seed write-up's central claim is that collapse follows *unbounded growth* of the mismatch, not
its initial size. A run's mismatch is summarised by a least-squares line through ln k3 over its
steps: the slope (per step), its standard error, and the fold change the line implies over the run
(``exp(slope * (steps - 1))``). A run is

- ``growth`` when the slope is positive beyond two standard errors *and* the fitted k3 at least
  doubles over the run (``GROWTH_FOLD``): a trend that is both real and large;
- ``shrinking`` when the slope is negative beyond two standard errors and the fit at least halves;
- ``bounded`` otherwise (flat, or a trend too small or too noisy to call).

The same fit restricted to the steps before a collapse tells whether the mismatch grew *before*
the reward fell (``pre_collapse_slope``).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

GROWTH_FOLD = 2.0  # fitted k3 must change at least this much over the fitted steps to be a trend
MIN_POINTS = 4  # fewer steps with k3 > 0 give no fit


@dataclasses.dataclass(frozen=True)
class Trend:
    """A least-squares line through ln k3 over RL steps."""

    slope: float  # d ln k3 / d step
    se: float  # its standard error
    fold: float  # exp(slope * (last step - first step)): the fitted change over the steps used
    n: int  # points used

    @property
    def label(self) -> str:
        """``growth``, ``shrinking`` or ``bounded`` (see the module docstring); ``–`` without a fit."""
        if self.n < MIN_POINTS or math.isnan(self.slope):
            return "–"
        if self.slope - 2 * self.se > 0 and self.fold >= GROWTH_FOLD:
            return "growth"
        if self.slope + 2 * self.se < 0 and self.fold <= 1 / GROWTH_FOLD:
            return "shrinking"
        return "bounded"


NO_TREND = Trend(math.nan, math.nan, math.nan, 0)


def k3_trend(records: list[dict], *, until: int | None = None) -> Trend:
    """The fit of ln k3 against step over ``records`` (steps < ``until`` only, when given)."""
    pts = [
        (r["step"], r["k3"])
        for r in records
        if r.get("k3") is not None and r["k3"] > 0 and (until is None or r["step"] < until)
    ]
    if len(pts) < MIN_POINTS:
        return NO_TREND
    x = np.asarray([p[0] for p in pts], dtype=np.float64)
    y = np.log(np.asarray([p[1] for p in pts], dtype=np.float64))
    xc = x - x.mean()
    sxx = float(np.sum(xc * xc))
    if sxx <= 0:
        return NO_TREND
    slope = float(np.sum(xc * (y - y.mean())) / sxx)
    resid = y - y.mean() - slope * xc
    se = math.sqrt(float(np.sum(resid * resid)) / max(len(pts) - 2, 1) / sxx)
    return Trend(slope, se, math.exp(slope * (x[-1] - x[0])), len(pts))


def mean_fold(trends: list[Trend]) -> float:
    """The seeds' fitted folds averaged as a geometric mean: the fold of their mean slope over the
    same steps (an arithmetic mean would make 0.5x and 2x a rise of 1.25x); NaN without a fit."""
    logs = [math.log(t.fold) for t in trends if t.n and t.fold > 0 and not math.isnan(t.fold)]
    return math.exp(sum(logs) / len(logs)) if logs else math.nan


__all__ = ["GROWTH_FOLD", "NO_TREND", "Trend", "k3_trend", "mean_fold"]
