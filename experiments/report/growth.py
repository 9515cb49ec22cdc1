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
the reward fell (``pre_collapse_slope``). With per-group records the line has one intercept per
sampler group and a shared slope (``k3_trend``): the slope is the mismatch's growth within groups.
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


def group_points(records: list[dict], until: int | None) -> list[tuple[str, float, float]]:
    """(group, step, k3) for every step a sampler group had scored tokens and a k3 > 0."""
    pts = []
    for r in records:
        if until is not None and r["step"] >= until:
            continue
        for key, k3 in r.items():
            if key.startswith("group/") and key.endswith("/k3") and k3 is not None and k3 > 0:
                g = key[len("group/"):-len("/k3")]
                if (r.get(f"group/{g}/tokens") or 0) > 0:
                    pts.append((g, float(r["step"]), float(k3)))
    return pts


def k3_trend(records: list[dict], *, until: int | None = None) -> Trend:
    """The fit of ln k3 against step over ``records`` (steps < ``until`` only, when given).

    When the records carry per-group k3 (``group/<g>/k3`` with ``group/<g>/tokens``), the fit is
    one slope with an intercept per group, over every (group, step) point: in a synchronous run a
    step's batch often comes from one or two groups, so the step's overall k3 jumps 100x with the
    batch's make-up (bf16 ~5e-4, mxfp4 ~0.1) and a slope through it measures which groups served
    late steps, not whether each group's mismatch grew. Without group records: the overall k3."""
    gpts = group_points(records, until)
    if len(gpts) >= MIN_POINTS and len({g for g, _, _ in gpts}) > 1:
        groups = sorted({g for g, _, _ in gpts})
        x = np.asarray([p[1] for p in gpts])
        y = np.log(np.asarray([p[2] for p in gpts]))
        # Demean within each group (the fixed-effects fit): the slope is shared, intercepts are not.
        xc, yc = x.copy(), y.copy()
        for g in groups:
            m = np.asarray([p[0] == g for p in gpts])
            xc[m] -= x[m].mean()
            yc[m] -= y[m].mean()
        dof = len(gpts) - len(groups) - 1
        return _fit(xc, yc, x, max(dof, 1), len(gpts))
    pts = [
        (r["step"], r["k3"])
        for r in records
        if r.get("k3") is not None and r["k3"] > 0 and (until is None or r["step"] < until)
    ]
    if len(pts) < MIN_POINTS:
        return NO_TREND
    x = np.asarray([p[0] for p in pts], dtype=np.float64)
    y = np.log(np.asarray([p[1] for p in pts], dtype=np.float64))
    return _fit(x - x.mean(), y - y.mean(), x, max(len(pts) - 2, 1), len(pts))


def _fit(xc: np.ndarray, yc: np.ndarray, x: np.ndarray, dof: int, n: int) -> Trend:
    """Least squares of centred ``yc`` on centred ``xc``; the fold spans ``x``'s range."""
    sxx = float(np.sum(xc * xc))
    if sxx <= 0:
        return NO_TREND
    slope = float(np.sum(xc * yc) / sxx)
    resid = yc - slope * xc
    se = math.sqrt(float(np.sum(resid * resid)) / dof / sxx)
    return Trend(slope, se, math.exp(slope * (x.max() - x.min())), n)


def mean_fold(trends: list[Trend]) -> float:
    """The seeds' fitted folds averaged as a geometric mean: the fold of their mean slope over the
    same steps (an arithmetic mean would make 0.5x and 2x a rise of 1.25x); NaN without a fit."""
    logs = [math.log(t.fold) for t in trends if t.n and t.fold > 0 and not math.isnan(t.fold)]
    return math.exp(sum(logs) / len(logs)) if logs else math.nan


__all__ = ["GROWTH_FOLD", "NO_TREND", "Trend", "group_points", "k3_trend", "mean_fold"]
