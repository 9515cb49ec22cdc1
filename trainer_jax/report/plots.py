"""The report's figures: seed-mean training curves per pool and condition (matplotlib, imported lazily)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from trainer_jax.report.runs import RunResult, grid_order

CURVES = {  # file name: (metric, title, log scale)
    "reward": ("reward_mean", "training reward (mean)", False),
    "kl": ("k3", "k3 estimate of KL(b || p) per token", True),
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


def plot_curves(results: list[RunResult], out_dir: Path, labels: dict[str, str]) -> list[Path]:
    """One PNG per curve in ``CURVES``: a panel per pool, one line (seed mean) per condition.

    Returns the files written (a curve no run has a value of is skipped).
    """
    import matplotlib

    # Headless: the report is written from sweeps and CI, where no display exists.
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    pools, conds = grid_order(results, labels)
    written = []
    for fname, (metric, title, log) in CURVES.items():
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
                ax.set_yscale("symlog", linthresh=1e-4)
        if drew:
            axes[0][-1].legend(fontsize=7)
            fig.tight_layout()
            path = out_dir / f"{fname}.png"
            fig.savefig(path, dpi=110)
            written.append(path)
        plt.close(fig)
    return written
