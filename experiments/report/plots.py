"""The report's figures: seed-mean training curves per pool and condition (matplotlib, imported lazily)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from experiments.report.runs import RunResult, grid_order

CURVES = {  # file name: (metric, title, log scale)
    "reward": ("reward_mean", "training reward (mean)", False),
    "kl": ("k3", "k3 estimate of KL(b || p) per token (log scale)", True),
    "grad_norm": ("grad_norm", "gradient norm (before clipping)", True),
    "entropy": ("entropy", "policy entropy per token", False),
    "out_of_range": ("out_of_range", "share of tokens with r outside [c_min, c_max]", False),
}


def _curve(runs: list[RunResult], metric: str) -> tuple[np.ndarray, np.ndarray]:
    """Seed-mean of a metric on the steps every run has."""
    series = [
        {r["step"]: r[metric] for r in run.records if r.get(metric) is not None} for run in runs if run.ok
    ]
    series = [s for s in series if s]
    if not series:
        return np.zeros(0), np.zeros(0)
    steps = sorted(set.intersection(*(set(s) for s in series)))
    return np.asarray(steps), np.asarray([np.mean([s[t] for s in series]) for t in steps])


def _log_scale(ax) -> None:
    """A log y axis when every plotted value is positive (k3 is), else symlog around 0."""
    ys = [y for line in ax.get_lines() for y in line.get_ydata()]
    if ys and min(ys) > 0:
        ax.set_yscale("log")
    else:
        ax.set_yscale("symlog", linthresh=1e-4)


def _pyplot():
    import matplotlib

    # Headless: the report is written from sweeps and CI, where no display exists.
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_phase(results: list[RunResult], path: Path, labels: dict[str, str]) -> Path | None:
    """The phase diagram of the mismatch dial: per condition, against sigma, the collapse step (runs
    that did not collapse drawn at the run length, hollow) and the slope of ln k3 per step.

    None (nothing written) when no finished run has a dial sigma."""
    runs = [r for r in results if r.ok and not np.isnan(r.sigma)]
    if not runs:
        return None
    plt = _pyplot()
    conds = [c for c in labels if any(r.condition == c for r in runs)]
    conds += sorted({r.condition for r in runs} - set(conds))
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(11, 3.8))
    for i, cond in enumerate(conds):
        rs = sorted((r for r in runs if r.condition == cond), key=lambda r: r.sigma)
        color = f"C{i}"
        sig = sorted({r.sigma for r in rs})
        for r in rs:
            done = r.collapsed  # a held-out collapse is seen at the end of the run
            a0.scatter(
                r.sigma, r.collapse_step or r.steps, marker="o", s=36,
                facecolors=color if done else "none", edgecolors=color,
            )
            a1.scatter(r.sigma, r.trend.slope, color=color, s=16, alpha=0.6)
        a1.plot(sig, [np.nanmean([r.trend.slope for r in rs if r.sigma == s]) for s in sig],
                color=color, label=labels.get(cond, cond))
        a0.plot([], [], color=color, marker="o", label=labels.get(cond, cond))
    a0.set_title("collapse step (hollow: no collapse within the run)", fontsize=9)
    a1.set_title("slope of ln k3 per RL step (0: bounded)", fontsize=9)
    a1.axhline(0.0, color="grey", lw=0.8)
    for ax in (a0, a1):
        ax.set_xscale("log")
        ax.set_xlabel("logit-noise sigma (mismatch dial)")
        ax.legend(fontsize=7)
    return _save(plt, fig, path)


def plot_group_oor(points: list[dict], path: Path) -> Path | None:
    """Claim 4: per sampler group (``{pool, group, k3, over}`` points), its over-representation
    (out-of-range share / policy-token share, ``seed_claims.CLAIM4_UNIT``) against its own k3.
    None when there are no points."""
    points = [p for p in points if p["k3"] > 0 and not np.isnan(p["over"])]
    if not points:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.8, 4.0))
    pools = sorted({p["pool"] for p in points})
    for i, pool in enumerate(pools):
        ps = [p for p in points if p["pool"] == pool]
        ax.scatter([p["k3"] for p in ps], [p["over"] for p in ps], color=f"C{i}", label=pool)
        for p in ps:
            ax.annotate(p["group"], (p["k3"], p["over"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("group's mean k3 (token-weighted)")
    ax.set_ylabel("out-of-range share / policy-token share")
    ax.set_title("claim 4: do out-of-range tokens concentrate in high-KL groups?", fontsize=9)
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


def plot_curves(results: list[RunResult], out_dir: Path, labels: dict[str, str],
                only: tuple[str, ...] | None = None) -> list[Path]:
    """One PNG per curve in ``CURVES``: a panel per pool, one line (seed mean) per condition.

    Returns the files written (a curve no run has a value of is skipped).
    """
    pools, conds = grid_order(results, labels)
    if not pools:  # no run directory yet (a sweep not started)
        return []
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for fname, (metric, title, log) in CURVES.items():
        if only is not None and fname not in only:
            continue
        fig, axes = plt.subplots(1, len(pools), figsize=(5.5 * len(pools), 3.6), sharey=True, squeeze=False)
        drew = False
        for ax, pool in zip(axes[0], pools, strict=True):
            for cond in conds:
                x, y = _curve([r for r in results if r.pool == pool and r.condition == cond], metric)
                if len(x):
                    ax.plot(x, y, label=labels.get(cond, cond), marker="." if len(x) < 30 else None)
                    drew = True
            ax.set_title(f"{pool}: {title}", fontsize=9)
            ax.set_xlabel("RL step")
            if log and drew:
                _log_scale(ax)
        if drew:
            for ax in axes[0]:  # every panel that has lines (a pool whose runs have not finished has none)
                if ax.get_lines():
                    ax.legend(fontsize=7)
            fig.tight_layout()
            path = out_dir / f"{fname}.png"
            fig.savefig(path, dpi=110)
            written.append(path)
        plt.close(fig)
    return written
