"""Issue 39's figures for ``docs/results.md``: the growth of ln k3 with its fitted slope, the phase
diagram over the mismatch dial, held-out pass@1 start -> end per cell, and claim 4's out-of-range
share against each group's policy-token share.

Each function takes the finished runs (``RunResult``) and writes one PNG, returning its path, or
None when there is nothing to draw (so the report never breaks on a sweep still running). The
phase of a run is decided here once (``run_phase``) and used by both the figure and the document.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np

from experiments.report.growth import group_points, mean_fold
from experiments.report.plots import _pyplot, _save
from experiments.report.runs import RunResult, grid_order, nanmean

COLLAPSED, GROWTH, BOUNDED = "collapsed", "growth", "bounded"
#: one letter per seed in the phase diagram's cells
LETTER = {COLLAPSED: "C", GROWTH: "G", BOUNDED: "B", "–": "?"}


def run_phase(r: RunResult) -> str:
    """``collapsed`` (a reward or held-out collapse, whatever k3 did), else ``growth`` (ln k3's
    slope > 2 s.e. and a >= 2x fitted rise: ``Trend.label``), else ``bounded`` (flat or shrinking);
    ``–`` for a run with neither a collapse nor enough k3 points to fit."""
    if r.collapsed:
        return COLLAPSED
    label = r.trend.label
    if label == "–":
        return "–"
    return GROWTH if label == "growth" else BOUNDED


def cell_phase(runs: list[RunResult]) -> str:
    """A cell's phase over its seeds: collapsed when at least half collapsed, else growth when at
    least half grew, else bounded (``–`` with no phase-able run). Half, not all: with 2 seeds one
    collapse is already a sign; the per-seed letters beside it show how many."""
    phases = [run_phase(r) for r in runs]
    phases = [p for p in phases if p != "–"]
    if not phases:
        return "–"
    for p in (COLLAPSED, GROWTH):
        if 2 * phases.count(p) >= len(phases):
            return p
    return BOUNDED


def phase_summary(results: list[RunResult], labels: dict[str, str]) -> str:
    """The phase diagram in one sentence: which cells collapsed or grew (with their seeds' letters),
    the count of bounded ones; "" without finished runs."""
    pools, conds = dial_order(results), list(dict.fromkeys(r.condition for r in results))
    cells = {(p, c): [r for r in results if r.pool == p and r.condition == c] for p in pools for c in conds}
    phase = {k: cell_phase(rs) for k, rs in cells.items() if rs}
    if not phase:
        return ""
    parts = []
    for name in (COLLAPSED, GROWTH):
        hits = [f"{labels.get(c, c)} / {p} ({' '.join(LETTER[run_phase(r)] for r in cells[(p, c)])})"
                for (p, c), ph in phase.items() if ph == name]
        if hits:
            parts.append(f"{name}: {', '.join(hits)}")
    bounded = sum(ph == BOUNDED for ph in phase.values())
    return "; ".join(parts + [f"bounded: the other {bounded} of {len(phase)} cells"])


def dial_order(results: list[RunResult]) -> list[str]:
    """Pools as the dial's positions: by logit-noise sigma where set, else by the pool's mean
    starting k3 (the mismatch before the policy moves); pools without sigma come first (sigma 0)."""
    pools = sorted({r.pool for r in results})

    def key(pool: str) -> tuple[float, float]:
        rs = [r for r in results if r.pool == pool]
        sigma = nanmean([r.sigma for r in rs])
        k3 = nanmean([r.k3_start for r in rs])
        return (0.0 if math.isnan(sigma) else sigma, math.inf if math.isnan(k3) else k3)

    return sorted(pools, key=key)


def _series(run: RunResult) -> dict[str, list[tuple[float, float]]]:
    """A run's k3 points per sampler group ((step, k3) where the group had scored tokens), or the
    overall k3 under "all" when the records carry no per-group k3 (``growth.k3_trend``'s points)."""
    pts = group_points(run.records, None)
    if len({g for g, _, _ in pts}) > 1:
        out: dict[str, list[tuple[float, float]]] = {}
        for g, x, y in pts:
            out.setdefault(g, []).append((x, y))
        return out
    return {"all": [(float(x["step"]), float(x["k3"])) for x in run.records if (x.get("k3") or 0) > 0]}


MARKERS = "osD^v<>ph*"


def plot_growth_fit(results: list[RunResult], path: Path, labels: dict[str, str]) -> Path | None:
    """k3 against step (log scale), one panel per pool, one colour per condition, one marker per
    sampler group (all seeds' points), and the fitted lines: the seed-mean slope of ln k3 with each
    group's own intercept (``growth.k3_trend`` fits one slope within groups), dashed, over the
    steps the group served; the legend gives slope ± s.e. and the fold over the run."""
    runs = [r for r in results if r.ok and r.records]
    pools, conds = grid_order(runs, labels)
    if not pools:
        return None
    plt = _pyplot()
    ncol = min(3, len(pools))
    nrow = -(-len(pools) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(5.2 * ncol, 3.9 * nrow), squeeze=False)
    for ax in axes.flat[len(pools):]:
        ax.set_visible(False)
    for ax, pool in zip(axes.flat, pools, strict=False):
        groups: list[str] = []
        for i, cond in enumerate(conds):
            rs = [r for r in runs if r.pool == pool and r.condition == cond]
            fits = [r.trend for r in rs if r.trend.n]
            if not rs or not fits:
                continue
            color = f"C{i}"
            slope = float(np.mean([t.slope for t in fits]))
            pooled: dict[str, list[tuple[float, float]]] = {}
            for r in rs:
                for g, pts in _series(r).items():
                    pooled.setdefault(g, []).extend(pts)
            for g, pts in sorted(pooled.items()):
                if g not in groups:
                    groups.append(g)
                x = np.asarray([p[0] for p in pts])
                y = np.log(np.asarray([p[1] for p in pts]))
                marker = MARKERS[groups.index(g) % len(MARKERS)]
                ax.scatter(x, np.exp(y), s=7, color=color, alpha=0.35, marker=marker)
                xs = np.asarray([x.min(), x.max()])
                ax.plot(xs, np.exp(y.mean() + slope * (xs - x.mean())), color=color, ls="--", lw=1.4)
            se = float(np.mean([t.se for t in fits]))
            ax.plot([], [], color=color, ls="--",
                    label=f"{labels.get(cond, cond)}: {slope:+.4f} ± {se:.4f}/step, "
                          f"{mean_fold(fits):.2f}x ({len(rs)} seed{'s' if len(rs) > 1 else ''})")
        for j, g in enumerate(groups):
            ax.scatter([], [], color="grey", marker=MARKERS[j % len(MARKERS)], s=12, label=g)
        with warnings.catch_warnings():  # a flat k3 (synthetic runs) gives equal y limits: harmless
            warnings.simplefilter("ignore", UserWarning)
            ax.set_yscale("log")
        ax.set_title(f"{pool}: k3 per step and group, fitted slope of ln k3", fontsize=9)
        ax.set_xlabel("RL step")
        ax.legend(fontsize=6, loc="best")
    return _save(plt, fig, path)


def plot_phase_map(results: list[RunResult], path: Path, labels: dict[str, str]) -> Path | None:
    """The phase diagram: pools along the dial (``dial_order``) x conditions; each cell coloured by
    log2 of the fitted fold of k3 over the run (geometric seed mean; red: grew, blue: shrank),
    marked with its phase (``cell_phase``; collapsed cells framed in black) and one letter per seed
    (C collapsed, G growth, B bounded)."""
    runs = [r for r in results if r.ok]
    if not runs:
        return None
    pools = dial_order(runs)
    _, conds = grid_order(runs, labels)
    plt = _pyplot()
    z = np.full((len(conds), len(pools)), np.nan)
    for i, c in enumerate(conds):
        for j, p in enumerate(pools):
            fold = mean_fold([r.trend for r in runs if r.pool == p and r.condition == c and r.trend.n])
            if not math.isnan(fold) and fold > 0:
                z[i, j] = math.log2(fold)
    lim = max(1.0, float(np.nanmax(np.abs(z))) if np.isfinite(z).any() else 1.0)
    fig, ax = plt.subplots(figsize=(1.9 * len(pools) + 2.5, 1.1 * len(conds) + 1.8))
    im = ax.imshow(np.ma.masked_invalid(z), cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto")
    for i, c in enumerate(conds):
        for j, p in enumerate(pools):
            rs = sorted((r for r in runs if r.pool == p and r.condition == c), key=lambda r: r.seed)
            if not rs:
                ax.text(j, i, "not run", ha="center", va="center", fontsize=7, color="grey")
                continue
            phase = cell_phase(rs)
            seeds = " ".join(f"s{r.seed}:{LETTER[run_phase(r)]}" for r in rs)
            fold = "" if math.isnan(z[i, j]) else f"{2 ** z[i, j]:.2f}x\n"
            ax.text(j, i, f"{phase}\n{fold}{seeds}", ha="center", va="center", fontsize=7.5,
                    fontweight="bold" if phase == COLLAPSED else "normal")
            if phase == COLLAPSED:
                ax.add_patch(plt.Rectangle((j - 0.48, i - 0.48), 0.96, 0.96, fill=False, lw=2.0, ec="black"))

    def col(p: str) -> str:
        rs = [r for r in runs if r.pool == p]
        sigma, k3 = nanmean([r.sigma for r in rs]), nanmean([r.k3_start for r in rs])
        dial = f"sigma {sigma:g}" if not math.isnan(sigma) else "no noise"
        return f"{p}\n{dial}\nk3 start {k3:.1e}"

    ax.set_xticks(range(len(pools)), [col(p) for p in pools], fontsize=7)
    ax.set_yticks(range(len(conds)), [labels.get(c, c) for c in conds], fontsize=8)
    ax.set_xlabel("mismatch dial: pools ordered by sigma, then by starting k3")
    fig.colorbar(im, ax=ax, label="log2 fold of k3 over the run")
    ax.set_title("phase diagram: collapsed / growth / bounded per cell (C/G/B per seed)", fontsize=9)
    return _save(plt, fig, path)


def plot_pass_at_1(results: list[RunResult], path: Path, labels: dict[str, str]) -> Path | None:
    """Held-out pass@1 at the start and the end of RL, per cell (pool x condition) and seed: an
    arrow from start to end (collapsed runs in red), the evaluations during the run as rings."""
    runs = [r for r in results if r.ok and not (math.isnan(r.eval_start) or math.isnan(r.eval_final))]
    if not runs:
        return None
    pools = dial_order(runs)
    _, conds = grid_order(runs, labels)
    cells = [(p, c) for p in pools for c in conds if any(r.pool == p and r.condition == c for r in runs)]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.5, 0.9 * len(cells) + 1.5), 3.8))
    for x, (p, c) in enumerate(cells):
        rs = sorted((r for r in runs if r.pool == p and r.condition == c), key=lambda r: r.seed)
        for k, r in enumerate(rs):
            dx = x + 0.18 * (k - (len(rs) - 1) / 2)
            up = r.eval_final >= r.eval_start
            color = "tab:red" if r.collapsed else "tab:green" if up else "tab:orange"
            ax.annotate("", xy=(dx, r.eval_final), xytext=(dx, r.eval_start),
                        arrowprops={"arrowstyle": "->", "color": color, "lw": 1.5})
            ax.scatter([dx], [r.eval_start], s=12, color="grey", zorder=3)
            during = [x["eval/pass@1"] for x in r.records
                      if x.get("eval/pass@1") is not None and x["step"] < r.steps]
            ax.scatter([dx] * len(during), during, s=14, facecolors="none", edgecolors="black", lw=0.7,
                       zorder=3)
            ax.annotate(f"s{r.seed}", (dx, r.eval_final), fontsize=6, xytext=(2, 0),
                        textcoords="offset points")
    ax.set_xticks(range(len(cells)), [f"{p}\n{labels.get(c, c)}" for p, c in cells], fontsize=7)
    ax.set_xlim(-0.6, len(cells) - 0.4)
    ax.set_ylim(0, 1)
    ax.set_ylabel("held-out pass@1")
    ax.set_title("held-out pass@1 per seed: start (grey) -> end (red: collapsed); rings: during", fontsize=9)
    return _save(plt, fig, path)


def plot_oor_vs_tokens(points: list[dict], path: Path) -> Path | None:
    """Claim 4 in its unit: per pool and sampler group, its share of the out-of-range tokens
    against its share of the policy tokens; on the diagonal a group is as mismatched as its
    volume, above it over-represented (labels: group, over-representation, k3)."""
    points = [p for p in points if not (math.isnan(p["oor_share"]) or math.isnan(p["token_share"]))]
    if not points:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.8, 4.6))
    for i, pool in enumerate(sorted({p["pool"] for p in points})):
        ps = [p for p in points if p["pool"] == pool]
        ax.scatter([p["token_share"] for p in ps], [p["oor_share"] for p in ps], color=f"C{i}", label=pool)
        for p in ps:
            ax.annotate(f"{p['group']} {p['over']:.2f}x (k3 {p['k3']:.1e})",
                        (p["token_share"], p["oor_share"]), fontsize=6.5, xytext=(3, 3),
                        textcoords="offset points")
    ax.plot([0, 1], [0, 1], color="grey", lw=0.8)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("share of the policy tokens")
    ax.set_ylabel("share of the out-of-range tokens")
    ax.set_title("claim 4: out-of-range share vs policy-token share per group", fontsize=9)
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


__all__ = [
    "BOUNDED", "COLLAPSED", "GROWTH", "cell_phase", "dial_order", "plot_growth_fit", "plot_oor_vs_tokens",
    "plot_pass_at_1", "plot_phase_map", "run_phase",
]
