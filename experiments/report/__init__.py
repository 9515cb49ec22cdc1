"""The results report: ``docs/results.md`` and ``docs/results/*.png`` generated from a sweep's runs.

Every number in the report is computed here from the run directories (``metrics.jsonl``,
``summary.json``, ``cell.json``, ``sweep.json``, and ``drift.json`` when the drift analysis ran);
the prose that states a finding is chosen by the numbers (e.g. whether GRPO collapsed), so
rerunning the sweep at another scale rewrites the conclusions with it.

Layout read: ``OUT/{pool}/{condition}/seed{N}/`` as written by ``experiments.sweep``.

Modules: ``runs`` (reading run directories into ``RunResult``), ``drift`` (the JAX drift analysis,
which imports JAX only when called), ``plots`` (the curves), ``grid`` / ``tables`` (the factual
sections), ``claims_outcome`` / ``claims_mismatch`` / ``prose`` (the written comparison), ``render``
(the document).
"""

from experiments.report.drift import drift_gradients
from experiments.report.plots import CURVES, plot_curves
from experiments.report.render import render, write_report
from experiments.report.runs import (
    REWARD_FLOOR,
    RunResult,
    collapse_step,
    collect,
    group_attribution,
    summarize_run,
)

__all__ = [
    "CURVES",
    "REWARD_FLOOR",
    "RunResult",
    "collect",
    "collapse_step",
    "drift_gradients",
    "group_attribution",
    "plot_curves",
    "render",
    "summarize_run",
    "write_report",
]
