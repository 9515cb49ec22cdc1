# ruff: noqa: E501 -- markdown table rows and report prose read better unbroken.
"""The report's factual sections: provenance, the per-cell table, figures, attribution and drift tables.

Each ``*_section`` returns markdown lines ending with a blank line ([] when there is nothing to show).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from experiments.report.grid import Grid
from experiments.report.runs import RunResult, current_command, mean_over_seeds, pooled_attribution


def fmt(x: float | None, spec: str = ".3f") -> str:
    """``x`` formatted with ``spec``; a dash for a missing (None or NaN) value."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return format(x, spec)


def provenance_section(grid: Grid, sweep: dict | None) -> list[str]:
    """How the grid was produced (commands, run time, grid shape, overrides per condition), from
    ``sweep.json``; then the failed cells, if any."""
    lines: list[str] = []
    if sweep:
        ok = grid.ok
        steps = sorted({r.steps for r in ok})
        warm = [w.get("wall_s", 0.0) for w in sweep.get("warm_start", []) if isinstance(w, dict)]
        cell_s = sum(r.wall_s for r in ok if not math.isnan(r.wall_s)) + sum(warm)
        lines += [
            "## How this was produced",
            "",
            f"- command: `{current_command(sweep.get('command') or 'mixrl-train sweep ' + sweep.get('sweep_file', '?'))}`",
            # The manifest's total counts every invocation, cells later discarded and rerun included;
            # what the grid itself costs is the sum of its cells.
            f"- run time of the grid: {fmt(cell_s, '.0f')} s ({fmt(cell_s / 60, '.0f')} min) summed over its "
            f"{len(ok)} cells (and the warm starts the last invocation ran) on this machine's 2 shared CPU cores "
            f"(last invocation finished {sweep.get('finished_utc', '?')} UTC); "
            f"per cell: {', '.join(f'{r.pool}/{r.condition}/seed{r.seed} {r.wall_s:.0f} s' for r in ok)}",
            f"- this report: `mixrl-train sweep {os.path.relpath(sweep.get('sweep_file', '?'))} --report-only "
            f"--out {os.path.relpath(sweep.get('out', '?'))}` (the drift analysis is cached in each run's drift.json)",
            f"- grid: {len(grid.pools)} pools ({', '.join(grid.pools)}) x {len(grid.conds)} conditions x "
            f"seeds {sweep.get('seeds')}; {len(ok)}/{len(grid.results)} cells finished; RL steps per run: "
            f"{', '.join(map(str, steps)) or '–'}",
            f"- shared overrides: `{' '.join(sweep.get('overrides', []))}`",
            "",
            "| condition | overrides |",
            "|---|---|",
        ]
        for c in grid.conds:
            ov = sweep.get("conditions", {}).get(c, {}).get("overrides", [])
            lines.append(f"| {grid.label(c)} | `{' '.join(ov)}` |")
        lines.append("")
    failed = [r for r in grid.results if not r.ok]
    if failed:
        lines += [
            "**Failed cells** (recorded, not fatal): "
            + "; ".join(f"{r.pool}/{r.condition}/seed{r.seed}: {r.error[:120]}" for r in failed),
            "",
        ]
    return lines


_MAIN_INTRO = (
    "Seed means. Pass rates are held-out pass@1 of the bf16 policy (start → final, best of the "
    "evaluations during/after training). Collapse: first step from which the reward alarm of "
    "`CollapseAlarms` (5-step moving average under half its best) or a reward moving average of "
    "~0 held at every step to the end of the run (a dip the run recovered from is not counted); "
    "KL alarm: first step at which k3's moving average exceeded 3x its level over the 5 steps "
    "after warmup + 5 (the trainer's rule). KL ratio: this condition's mean k3 on the mixed "
    "pool over the homogeneous pool's."
)


def _main_row(grid: Grid, pool: str, cond: str) -> str:
    """One cell's row of the main table: seed means of its finished runs."""
    runs = grid.runs(pool, cond)

    def m(attr: str, spec: str = ".3f") -> str:
        return fmt(mean_over_seeds(runs, attr), spec)

    coll = [r.collapse_step for r in runs if r.collapse_step is not None]
    kla = [r.kl_alarm_step for r in runs if r.kl_alarm_step is not None]
    mixed_k3 = mean_over_seeds(grid.by.get(("mixed", cond), []), "mean_k3")
    homog_k3 = mean_over_seeds(grid.by.get(("homogeneous", cond), []), "mean_k3")
    ratio = mixed_k3 / homog_k3 if homog_k3 and homog_k3 > 0 else math.nan
    return (
        f"| {grid.label(cond)} | {pool} | {len(runs)}/{len(grid.by[(pool, cond)])} | "
        f"{m('eval_start')} | {m('eval_final')} | {m('eval_best')} | "
        f"{(f'{min(coll)} ({len(coll)}/{len(runs)} seeds)') if coll else 'none'} | "
        f"{(f'{min(kla)} ({len(kla)}/{len(runs)})') if kla else 'none'} | "
        f"{m('mean_k3', '.2e')} | {fmt(ratio, '.2f') if pool == 'mixed' else ''} | "
        f"{m('k3_start', '.2e')} | {m('k3_growth', '.2f')} | "
        f"{m('mean_staleness', '.2f')} | {m('mean_oor', '.4f')} | {m('max_grad_norm', '.3g')} | "
        f"{m('entropy_first')} → {m('entropy_last')} | {m('reward_first')} → {m('reward_last')} |"
    )


def main_table_section(grid: Grid) -> list[str]:
    """Per condition and pool, the seed means of every ``RunResult`` number (a row per cell that ran)."""
    lines = [
        "## Per condition and pool",
        "",
        _MAIN_INTRO,
        "",
        "| condition | pool | seeds | pass@1 start | final | best | collapse at step | KL alarm at | "
        "mean k3 | k3 mixed/homog. | k3 first 2 steps | k3 last/first third | mean staleness | mean out-of-range | max grad norm | "
        "entropy first → last third | reward first → last third |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [_main_row(grid, p, c) for c in grid.conds for p in grid.pools if grid.by[(p, c)]]
    return lines + [""]


def figures_section(figures: list[Path], doc_path: Path) -> list[str]:
    """The curves, linked relative to the document."""
    if not figures:
        return []
    lines = ["## Curves", "", "Seed means, one line per condition, one panel per pool (k3 on a log scale); the phase diagram (when the grid has a dial sigma) and the per-group out-of-range share against KL follow.", ""]
    for f in figures:
        lines += [f"![{f.stem}]({os.path.relpath(f, doc_path.parent)})", ""]
    return lines


def attribution_section(results: list[RunResult]) -> list[str]:
    """Per sampler group of the mixed pool (all conditions and seeds pooled): sample and policy-token
    shares vs out-of-range share (over-representation per policy token, as claim 4 counts it in
    ``seed_claims.CLAIM4_UNIT``), out-of-range rate, mean k3."""
    mixed_runs = [r for r in results if r.pool == "mixed" and r.ok]
    if not mixed_runs:
        return []
    lines = [
        "## Per-group attribution (mixed pool, all conditions and seeds pooled)",
        "",
        "Share of the trained samples and of the scored policy tokens each sampler group produced vs "
        "its share of the out-of-range tokens (r outside [c_min, c_max]) and its own token-weighted k3. "
        "A group whose out-of-range share exceeds its policy-token share contributes more mismatch than "
        "its volume; tokens, not samples, because out-of-range is counted per token and replies differ in "
        "length (the seed write-up's H100 FP8 group, quoted per sample: 10 % of samples, 29 % of "
        "out-of-range tokens).",
        "",
        "| group | sample share | policy-token share | out-of-range share | out-of-range rate | mean k3 | "
        "oor share / policy-token share |",
        "|---|---|---|---|---|---|---|",
    ]
    for g, v in pooled_attribution(mixed_runs).items():
        ratio = v["oor_share"] / v["token_share"] if v["token_share"] else math.nan
        lines.append(
            f"| {g} | {fmt(v['sample_share'])} | {fmt(v['token_share'])} | {fmt(v['oor_share'])} | "
            f"{fmt(v['oor_rate'], '.4f')} | {fmt(v['k3'], '.2e')} | {fmt(ratio, '.2f')} |"
        )
    return lines + [""]


def drift_section(drift: dict[str, dict]) -> list[str]:
    """The drift analysis per analysed run: gradient norms of the batch and of each group's samples."""
    if not drift:
        return []
    lines = [
        "## Drift on real sampler outputs (constant advantage)",
        "",
        "The last saved training batch of a run, its final weights, every advantage set to 1. GRPO's "
        "signal is then zero, so the gradient is drift plus sampling noise. `uncorrected`: is none, "
        "no SC, no replay; `SC`: is none + score centering; `SC+MIS+replay`; `drift` = |g_uncorrected − "
        "g_SC|, the expected gradient toward the sampler distribution that SC removes exactly "
        "(docs/design.md §4).",
        "",
        "| run | batch / group | samples | tokens | ‖g‖ uncorrected | ‖g‖ SC | ‖g‖ SC+MIS+replay | ‖drift‖ | "
        "drift / uncorrected |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, d in drift.items():
        for label, v in [("batch", d["batch"]), *d.get("groups", {}).items()]:
            lines.append(
                f"| {name} | {label} | {v['samples']} | {v['tokens']} | {fmt(v['uncorrected'], '.3g')} | "
                f"{fmt(v['sc'], '.3g')} | {fmt(v['sc_mis_replay'], '.3g')} | {fmt(v['drift'], '.3g')} | "
                f"{fmt(v['drift'] / v['uncorrected'] if v['uncorrected'] else math.nan, '.2f')} |"
            )
    return lines + [""]
