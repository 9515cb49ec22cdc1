# ruff: noqa: E501 -- synthetic records and expected report lines read better unbroken.
"""Issue 39's report pieces on small synthetic run directories: claim 4 in one unit (policy
tokens), the phase classification, the figures docs/results.md links, a sweep with a cell still
running, and the archive of a sweep's small outputs the document is regenerated from."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from experiments.report import collect
from experiments.report.figures import BOUNDED, COLLAPSED, GROWTH, cell_phase, run_phase
from experiments.report.grid import Grid
from experiments.report.growth import k3_trend
from experiments.report.runs import RunResult
from experiments.report.seed_claims import NOT_REPRODUCED, REPRODUCED, group_kl_points, verdicts
from experiments.report.summary import main as summary_main

ROOT = Path(__file__).resolve().parents[2]
N = 12
LABELS = {"grpo": "GRPO", "sc_mis": "SC + MIS"}


def _run(root: Path, pool: str, cond: str, seed: int = 0, *, rate: float = 0.0, groups: dict | None = None,
         eval_end: float = 0.5, finished: bool = True, config: str = "configs/local_mixed.yaml") -> Path:
    """A run whose k3 (overall and each group's) changes by exp(rate) a step; ``groups``: name ->
    (sample share, policy tokens a step, out-of-range rate, k3 at step 0)."""
    groups = groups or {"a": (0.5, 100.0, 0.001, 1e-3), "b": (0.5, 100.0, 0.001, 1e-3)}
    run = root / pool / cond / f"seed{seed}"
    run.mkdir(parents=True)
    lines = []
    for s in range(1, N + 1):
        rec = {"step": s, "loss": 0.1, "reward_mean": 0.3, "k3": 1e-3 * math.exp(rate * s), "samples_trained": 64}
        for g, (share, tokens, oor, k3) in groups.items():
            rec |= {f"group/{g}/sample_share": share, f"group/{g}/tokens": tokens,
                    f"group/{g}/out_of_range": oor, f"group/{g}/k3": k3 * math.exp(rate * s)}
        lines.append(json.dumps(rec))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if finished:
        (run / "summary.json").write_text(json.dumps({"eval_start": {"eval/pass@1": 0.5}, "eval_end": {"eval/pass@1": eval_end}}))
        cmd = [str(ROOT / ".venv/bin/mixrl-train"), "--config", str(ROOT / config), "--run-dir", str(run)]
        (run / "cell.json").write_text(json.dumps({"ok": True, "wall_s": 20.0, "returncode": 0, "command": cmd}))
    return run


def test_claim_4_counts_in_policy_tokens(tmp_path):
    # The case by hand: same sample shares, but `short` writes 100 policy tokens a step and
    # `long` 300. Out-of-range tokens a step: long 300 x 0.02 = 6, short 100 x 0.05 = 5 (of 11).
    # Per sample long looks over-represented (6/11 / 0.5 = 1.09x vs 0.91x); per policy token
    # short is (5/11 / 0.25 = 1.82x = its rate 0.05 over the pool's 11/400) and it has the larger k3.
    # Three runs alike: the per-run interval's n (issue 48's rule needs 3).
    groups = {"long": (0.5, 300.0, 0.02, 0.01), "short": (0.5, 100.0, 0.05, 0.2)}
    for seed in range(3):
        _run(tmp_path, "mixed", "grpo", seed, groups=groups)
    pts = {p["group"]: p for p in group_kl_points(collect(tmp_path))}
    assert math.isclose(pts["short"]["token_share"], 0.25) and math.isclose(pts["short"]["sample_share"], 0.5)
    assert math.isclose(pts["short"]["oor_share"], 5 / 11)
    assert math.isclose(pts["short"]["over"], (5 / 11) / 0.25) and math.isclose(pts["short"]["over"], 0.05 / (11 / 400))
    assert math.isclose(pts["long"]["over"], (6 / 11) / 0.75)
    c4 = verdicts(Grid.of(collect(tmp_path), LABELS, {}))[3]
    assert c4.verdict == REPRODUCED, c4.text
    assert "`short` (k3 2.00e-01) gave 45 % of the out-of-range tokens from 25 % of the policy tokens (1.82x; 50 % of the samples; per run 1.82 [1.82, 1.82]x, n = 3, 95 % bootstrap)" in c4.text
    assert "most over-represented: `short` (1.82x)" in c4.text and "policy tokens" in c4.text
    # Two runs of it: not assessable, however far above 1.5x.
    two = Grid.of([r for r in collect(tmp_path) if r.seed < 2], LABELS, {})
    assert verdicts(two)[3].verdict == "not assessable at n = 2 (a verdict needs 3 runs)"
    # The largest-KL group under its token share: not reproduced, whatever its per-sample ratio.
    flip = tmp_path / "flip"
    _run(flip, "mixed", "grpo", groups={"long": (0.5, 300.0, 0.02, 0.2), "short": (0.5, 100.0, 0.05, 0.01)})
    c4 = verdicts(Grid.of(collect(flip), LABELS, {}))[3]
    assert c4.verdict == NOT_REPRODUCED and "largest-KL group `long`" in c4.text and "(0.73x;" in c4.text


def _result(collapse: int | None = None, rate: float = 0.0, eval_end: float = 0.5, seed: int = 0) -> RunResult:
    recs = [{"step": s, "k3": 1e-3 * math.exp(rate * s)} for s in range(1, N + 1)]
    r = RunResult("mixed", "grpo", seed, Path("."), ok=True, steps=N, eval_start=0.5, eval_final=eval_end,
                  collapse_step=collapse, trend=k3_trend(recs))
    return r


def test_phase_of_runs_and_cells():
    grow, flat, shrink = math.log(3) / (N - 1), 0.0, -math.log(3) / (N - 1)
    assert run_phase(_result(rate=grow)) == GROWTH
    assert run_phase(_result(rate=flat)) == BOUNDED and run_phase(_result(rate=shrink)) == BOUNDED
    # A collapse decides whatever k3 did: by reward step, or held-out pass@1 halving (no sample count).
    assert run_phase(_result(collapse=7, rate=flat)) == COLLAPSED
    assert run_phase(_result(rate=grow, eval_end=0.1)) == COLLAPSED
    assert run_phase(RunResult("m", "g", 0, Path("."), ok=True)) == "–"
    # A cell: at least half its seeds decide, collapse before growth.
    assert cell_phase([_result(collapse=5), _result(rate=grow, seed=1)]) == COLLAPSED
    assert cell_phase([_result(rate=flat), _result(rate=grow, seed=1)]) == GROWTH
    assert cell_phase([_result(rate=flat), _result(rate=flat, seed=1), _result(rate=grow, seed=2)]) == BOUNDED
    assert cell_phase([]) == "–"


def test_summary_draws_its_figures_and_lists_a_running_cell(tmp_path):
    sweep = tmp_path / "runs"
    mixed = {"bf16": (0.5, 100.0, 0.0005, 1e-3), "nvfp4": (0.5, 60.0, 0.03, 0.15)}
    for seed in (0, 1):
        _run(sweep, "mixed", "grpo", seed, rate=0.12 if seed else 0.0, groups=mixed, eval_end=0.1 if seed else 0.5)
        _run(sweep, "mixed", "sc_mis", seed, groups=mixed)
        _run(sweep, "homogeneous", "grpo", seed, config="configs/local_homogeneous.yaml")
    _run(sweep, "homogeneous", "sc_mis", 0, finished=False)  # still running: metrics, no cell.json
    # The archive the document is rebuilt from: relative paths, running cell kept without cell.json.
    from experiments.report.archive import archive

    kept_dir = tmp_path / "ablation_long"
    copied = archive(sweep, kept_dir, command="run.sh")
    assert "homogeneous/sc_mis/seed0 (running)" in copied and len(copied) == 7
    cell = json.loads((kept_dir / "mixed" / "grpo" / "seed0" / "cell.json").read_text())
    assert cell["command"][1:3] == ["--config", "configs/local_mixed.yaml"]
    assert not list(kept_dir.rglob("metrics.jsonl")) and len(list(kept_dir.rglob("metrics.jsonl.gz"))) == 7
    # The same cells at another length, listed beside the judged sweep with their own verdicts.
    short = tmp_path / "ablation_short"
    _run(short, "mixed", "grpo", groups=mixed)
    _run(short, "homogeneous", "grpo", config="configs/local_homogeneous.yaml")
    doc = tmp_path / "docs" / "results.md"
    sweep_file = ROOT / "configs" / "ablation_long.yaml"
    assert summary_main(["--sweep", f"{sweep_file}={kept_dir}", "--listed", f"{sweep_file}={short}@the same cells, shorter",
                         "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "This document: `python -m experiments.report.summary --sweep " in text
    assert "- command: `run.sh` (runs' small outputs kept in `" in text
    assert "### short grid (the same cells, shorter: not in the claims below)" in text
    assert "### The same claims judged on the short grid alone (the same cells, shorter)" in text
    assert "- why this setting (the sweep file's comment): at lr 5e-4" in text
    figs = ("phase_map", "growth", "pass_at_1", "oor_vs_tokens", "group_oor_vs_kl", "kl", "reward")
    for f in figs:
        assert (tmp_path / "docs" / "results" / f"{f}.png").stat().st_size > 5000, f
        assert f"(results/{f}.png)" in text, f
    assert text.count("![") >= 6
    assert "started, not finished** (not in the numbers below): homogeneous/sc_mis/seed0 (12 steps so far)" in text
    assert "cells finished: 6 of 8 planned" in text and "homogeneous/sc_mis/seed1 (not run)" in text
    # The phase table: GRPO / mixed has one collapsed seed of two, so the cell reads collapsed.
    assert "| mixed | – | " in text and "| GRPO | collapsed | " in text and "seed0: bounded, seed1: collapsed" in text
    assert "out-of-range share / policy-token share" in text
    assert "| long grid | mixed | GRPO | 1 | 12 | collapsed | +0.1200 ± 0.0000 | 3.74x | 0.500 → 0.100 |" in text
    assert "| short grid | mixed | GRPO | 0 | 12 | bounded |" in text


def test_k3_slope_is_fitted_within_groups():
    # A synchronous step's batch from one group at a time: bf16 (k3 ~5e-4) on even steps, mxfp4
    # (~0.1) on odd ones, each growing 5 % a step. The overall k3 jumps 200x step to step; the
    # within-group fit recovers the 0.05 exactly, the late steps' make-up cannot fake a trend.
    recs = []
    for s in range(1, 25):
        g, base = ("bf16", 5e-4) if s % 2 == 0 or s > 20 else ("mxfp4", 0.1)
        k3 = base * math.exp(0.05 * s)
        recs.append({"step": s, "k3": k3, f"group/{g}/k3": k3, f"group/{g}/tokens": 50.0})
    t = k3_trend(recs)
    assert t.n == 24 and math.isclose(t.slope, 0.05, rel_tol=1e-9) and t.label == "growth"
    overall = k3_trend([{"step": r["step"], "k3": r["k3"]} for r in recs])
    assert overall.slope < 0  # bf16 alone serves the last steps: the plain fit reads shrinking


def test_phase_summary_names_the_cells_that_left_bounded():
    from experiments.report.figures import phase_summary

    grow = math.log(3) / (N - 1)
    runs = [_result(collapse=5), _result(seed=1), _result(rate=grow, seed=0)]
    runs[2].pool, runs[2].condition = "sigma1.0", "sc_mis"
    runs += [dataclasses.replace(runs[2], condition="grpo", trend=_result().trend)]
    text = phase_summary(runs, {"grpo": "GRPO", "sc_mis": "SC + MIS"})
    assert text == "collapsed: GRPO / mixed (C B); growth: SC + MIS / sigma1.0 (G); bounded: the other 1 of 3 cells"
    assert phase_summary([], {}) == ""


def test_a_grid_continues_from_its_archive_in_a_fresh_checkout(tmp_path):
    """The archive keeps a small shared warm start's weights; --restore puts them and the finished
    cells back so the sweep skips those cells and the rest start from the very same weights."""
    from experiments.report.archive import WARM_START_MAX_BYTES, archive
    from experiments.report.archive import main as archive_main
    from experiments.sweep import CELL_FILE

    runs = tmp_path / "runs"
    _run(runs, "mixed", "grpo", 0)
    _run(runs, "mixed", "grpo", 1, finished=False)  # interrupted: archived, but not restored as done
    warm = runs / "warm_start" / "seed0"
    warm.mkdir(parents=True)
    (warm / "config.json").write_text("{}")
    (warm / "model-00001-of-00001.safetensors").write_bytes(b"w" * 1000)
    (runs / "warm_start" / "seed0.json").write_text(json.dumps({"seed": 0, "wall_s": 30.0}))
    big = runs / "warm_start" / "seed1"  # a real model's warm start is never put in the repository
    big.mkdir()
    with open(big / "model.safetensors", "wb") as f:
        f.truncate(WARM_START_MAX_BYTES + 1)
    (runs / "warm_start" / "seed1.json").write_text(json.dumps({"seed": 1, "wall_s": 30.0}))
    kept = tmp_path / "docs" / "results_x"
    archive(runs, kept)
    assert (kept / "warm_start" / "seed0" / "model-00001-of-00001.safetensors").read_bytes() == b"w" * 1000
    assert not (kept / "warm_start" / "seed1").exists() and (kept / "warm_start" / "seed1.json").exists()
    fresh = tmp_path / "fresh_runs"
    assert archive_main([str(kept), str(fresh), "--restore"]) == 0
    assert (fresh / "warm_start" / "seed0" / "config.json").exists()
    assert json.loads((fresh / "mixed" / "grpo" / "seed0" / CELL_FILE).read_text())["ok"] is True
    assert not (fresh / "mixed" / "grpo" / "seed1").exists()
    assert [r.seed for r in collect(fresh) if r.ok] == [0]  # the restored cell reads as finished
    # A second restore leaves a cell that finished in the run directory alone.
    (fresh / "mixed" / "grpo" / "seed0" / "marker").write_text("mine")
    assert archive_main([str(kept), str(fresh), "--restore"]) == 0
    assert (fresh / "mixed" / "grpo" / "seed0" / "marker").exists()
