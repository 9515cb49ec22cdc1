# ruff: noqa: E501 -- synthetic records and expected report lines read better unbroken.
"""The issue-20 report pieces on small synthetic run directories: the slope of ln k3, the four
seed claims' verdicts under issue 48's interval rule (enough seeds a cell to separate, and the
same scenarios at 2 seeds, which decide nothing), the phase diagram, the per-group out-of-range vs
KL figure, and the summary document (decision table, the command that finishes a grid) with the
README's generated blocks (each grid's mode)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from experiments.report import collect
from experiments.report.grid import Grid
from experiments.report.growth import k3_trend
from experiments.report.seed_claims import NOT_OBSERVABLE, NOT_REPRODUCED, REPRODUCED, verdicts
from experiments.report.summary import finish_command, load_sweep_runs, write_summary

ROOT = Path(__file__).resolve().parents[2]
N = 24
LABELS = {"grpo": "GRPO", "sc_mis": "SC + MIS"}


def _run(root, pool, cond, seed=0, *, k3, rewards, group_k3=None, group_oor=None, sigma=None, wall=30.0, eval_start=0.2, eval_end=0.3,
         config="x.yaml", staleness=None):
    """A run dir: ``k3``/``rewards`` per step; per group, its k3 factor and out-of-range rate;
    ``staleness`` per step when given (the trainer logs it; absent here otherwise)."""
    group_k3 = group_k3 or {"a": 1.0, "b": 1.0}
    group_oor = group_oor or {g: 0.001 for g in group_k3}
    run = root / pool / cond / f"seed{seed}"
    run.mkdir(parents=True)
    lines = []
    for s, (k, r) in enumerate(zip(k3, rewards, strict=True), 1):
        rec = {"step": s, "loss": 0.1, "grad_norm": 1.0, "reward_mean": r, "k3": k, "entropy": 1.0,
               "out_of_range": 0.001, "samples_trained": 8}
        if staleness is not None:
            rec["staleness"] = staleness
        for g in group_k3:
            rec |= {f"group/{g}/tokens": 100.0, f"group/{g}/k3": k * group_k3[g],
                    f"group/{g}/out_of_range": group_oor[g], f"group/{g}/sample_share": 1 / len(group_k3)}
        lines.append(json.dumps(rec))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run / "summary.json").write_text(json.dumps({"eval_start": {"eval/pass@1": eval_start}, "eval_end": {"eval/pass@1": eval_end}}))
    cmd = ["mixrl-train", "--config", config, "--run-dir", str(run)]
    if sigma is not None:
        cmd.append(f"groups=[{{name: a, recipe: bf16, logit_noise: {sigma}}}]")
    (run / "cell.json").write_text(json.dumps({"ok": True, "wall_s": wall, "returncode": 0, "command": cmd}))


def _grid(root: Path) -> Grid:
    return Grid.of(collect(root), LABELS, {})


def test_k3_trend_labels():
    steps = np.arange(1, N + 1)
    grow = [{"step": int(s), "k3": 1e-3 * math.exp(0.1 * s)} for s in steps]
    t = k3_trend(grow)
    assert t.label == "growth" and abs(t.slope - 0.1) < 1e-9 and t.fold > 2
    rng = np.random.default_rng(0)
    flat = [{"step": int(s), "k3": 1e-3 * math.exp(0.1 * rng.standard_normal())} for s in steps]
    assert k3_trend(flat).label == "bounded"
    shrink = [{"step": int(s), "k3": 1e-2 * math.exp(-0.1 * s)} for s in steps]
    assert k3_trend(shrink).label == "shrinking"
    assert k3_trend(grow[:3]).label == "–"
    # Restricted to the steps before a collapse.
    assert k3_trend(grow, until=10).n == 9


def _seed_like(root: Path, seeds=range(6), **kw) -> None:
    """GRPO on the mixed pool: k3 grows 10 %/step and the reward falls to 0 after step 14 (the
    collapse read at step 17, by its 5-step moving average); every other cell flat. The mixed pool's fp8 group has 3x the KL and most of the out-of-range tokens. Every
    seed alike: 6 a cell separate 6 / 6 from 0 / 6 (Wilson [0.61, 1] vs [0, 0.39])."""
    grow = [1e-3 * math.exp(0.1 * s) for s in range(1, N + 1)]
    flat = [1e-3] * N
    fall = [0.4] * 14 + [0.0] * (N - 14)
    up = [0.4] * N
    mixed = {"group_k3": {"bf16": 0.5, "fp8": 3.0}, "group_oor": {"bf16": 0.001, "fp8": 0.01}}
    for seed in seeds:
        _run(root, "mixed", "grpo", seed, k3=grow, rewards=fall, **mixed, **kw)
        _run(root, "mixed", "sc_mis", seed, k3=flat, rewards=up, **mixed, **kw)  # same starting k3, held: size does not decide
        _run(root, "homogeneous", "grpo", seed, k3=flat, rewards=up, **kw)
        _run(root, "homogeneous", "sc_mis", seed, k3=flat, rewards=up, **kw)


def test_verdicts_when_the_seed_reproduces(tmp_path):
    _seed_like(tmp_path)
    grid = _grid(tmp_path)
    v = {c.number: c for c in verdicts(grid)}
    assert [v[i].verdict for i in (1, 2, 3, 4)] == [REPRODUCED] * 4, [c.markdown() for c in v.values()]
    assert "GRPO / mixed: collapsed 6 / 6 = 1.00 [0.61, 1.00], final held-out pass@1 0.300 [0.300, 0.300]" in v[1].text
    assert "GRPO / homogeneous: collapsed 0 / 6 = 0.00 [0.00, 0.39]" in v[1].text
    assert "17.0 vs 25.0" in v[1].text  # mean collapse step (reward at step 17); a run that held counts as 24 + 1
    assert "growth" in v[2].text and "+0.100/step" in v[2].text
    assert "Growth share, collapsed: 6 / 6 = 1.00 [0.61, 1.00]; held: 0 / 18 = 0.00 [0.00, 0.18]" in v[2].text
    assert "k3 growth (over the run, or before a collapse): 0/12" in v[3].text
    # GRPO in the same pools: the 6 mixed runs grew, the 6 homogeneous ones did not.
    assert "Growth share, corrected: 0 / 12 = 0.00 [0.00, 0.24]; GRPO: 6 / 12 = 0.50 [0.25, 0.75]" in v[3].text
    assert "On the homogeneous pool" not in v[3].text  # its corrected runs stayed flat
    assert "`fp8`" in v[4].text and "91 %" in v[4].text  # 0.01 / (0.01 + 0.001) of the tokens
    assert "per run 1.82 [1.82, 1.82]x, n = 12" in v[4].text  # 0.909 / 0.5 of the tokens, every run alike


def test_two_seeds_a_cell_decide_nothing(tmp_path):
    # The same grid at 2 seeds: 2 / 2 vs 0 / 2 is the split seed noise alone gave in earlier grids.
    _seed_like(tmp_path, seeds=range(2))
    v = {c.number: c for c in verdicts(_grid(tmp_path))}
    assert v[1].verdict == "not assessable at n = 2 / 2 (a verdict needs 3 runs a side)", v[1].text
    assert "GRPO / mixed: collapsed 2 / 2 = 1.00 [0.34, 1.00]" in v[1].text
    assert "GRPO / homogeneous: collapsed 0 / 2 = 0.00 [0.00, 0.66]" in v[1].text
    assert v[2].verdict == "not assessable at n = 2 / 6 (a verdict needs 3 runs a side)", v[2].text
    # Claim 3 pools both pools' runs: 4 a side is assessable, but 0 / 4 and 2 / 4 overlap.
    assert v[3].verdict == "not distinguishable at n = 4 / 4", v[3].text
    assert "Growth share, corrected: 0 / 4 = 0.00 [0.00, 0.49]; GRPO: 2 / 4 = 0.50 [0.15, 0.85]" in v[3].text
    assert v[4].verdict == REPRODUCED and "n = 4" in v[4].text  # 4 runs of the mixed pool, every one 1.82x
    # Claim 4 counts runs, not cells: one seed leaves the mixed pool's 2 runs short of a verdict.
    one = tmp_path / "one"
    _seed_like(one, seeds=range(1))
    v = {c.number: c for c in verdicts(_grid(one))}
    assert v[4].verdict == "not assessable at n = 2 (a verdict needs 3 runs)", v[4].text
    assert v[1].verdict.startswith("not assessable at n = 1 / 1")


def test_verdicts_when_nothing_happens(tmp_path):
    flat, up = [1e-3] * N, [0.4] * N
    even = {"group_k3": {"bf16": 0.5, "fp8": 3.0}, "group_oor": {"bf16": 0.002, "fp8": 0.002}}
    for seed in range(6):
        for pool in ("mixed", "homogeneous"):
            for cond in ("grpo", "sc_mis"):
                _run(tmp_path, pool, cond, seed, k3=flat, rewards=up, **(even if pool == "mixed" else {}))
    v = {c.number: c for c in verdicts(_grid(tmp_path))}
    # 0 / 6 against 0 / 6: the same interval, so the claim is not shown (nor its opposite).
    assert v[1].verdict == "not distinguishable at n = 6 / 6", v[1].text
    assert "GRPO / mixed: collapsed 0 / 6 = 0.00 [0.00, 0.39]" in v[1].text
    assert v[2].verdict == NOT_OBSERVABLE and "no run collapsed" in v[2].text
    # Corrected runs that grew no more than GRPO's (neither grew) are not shown to bound anything.
    assert v[3].verdict == "not distinguishable at n = 12 / 12", v[3].text
    assert "Growth share, corrected: 0 / 12 = 0.00 [0.00, 0.24]; GRPO: 0 / 12 = 0.00 [0.00, 0.24]" in v[3].text
    assert v[4].verdict == NOT_REPRODUCED and "(1.00x" in v[4].text  # fp8: half the tokens, half the out-of-range
    # Without a reward signal claim 1 cannot be judged; with one group there is nothing to attribute.
    # One seed: "not observable" comes before "not assessable".
    dead = tmp_path / "dead"
    for pool in ("mixed", "homogeneous"):
        _run(dead, pool, "grpo", k3=flat, rewards=[0.0] * N, group_k3={"a": 1.0}, eval_start=0.0, eval_end=0.0)
    v = {c.number: c for c in verdicts(_grid(dead))}
    assert v[1].verdict == NOT_OBSERVABLE and v[4].verdict == NOT_OBSERVABLE
    assert v[3].verdict == NOT_OBSERVABLE
    # The same flat grid at 2 seeds: claim 1 is not assessable, whatever the counts.
    two = tmp_path / "two"
    for seed in range(2):
        for pool in ("mixed", "homogeneous"):
            _run(two, pool, "grpo", seed, k3=flat, rewards=up)
    assert verdicts(_grid(two))[0].verdict == "not assessable at n = 2 / 2 (a verdict needs 3 runs a side)"


def test_corrected_growth_is_not_bounded(tmp_path):
    steep = [1e-3 * math.exp(0.2 * s) for s in range(1, N + 1)]
    # A pool where SC + MIS grew in every seed and GRPO did not: the claim's opposite.
    for seed in range(6):
        _run(tmp_path, "aggressive", "sc_mis", seed, k3=steep, rewards=[0.4] * N)
        _run(tmp_path, "aggressive", "grpo", seed, k3=[1e-3] * N, rewards=[0.4] * N)
    v = {c.number: c for c in verdicts(_grid(tmp_path))}
    assert v[3].verdict == NOT_REPRODUCED and "aggressive/sc_mis/seed0 slope +0.200/step over the run (growth)" in v[3].text
    assert "Growth share, corrected: 6 / 6 = 1.00 [0.61, 1.00]; GRPO: 0 / 6 = 0.00 [0.00, 0.39]" in v[3].text
    # Added to the seed's grid, whose GRPO grew on the mixed pool: 6 / 18 vs 6 / 12, no longer reproduced.
    seed = tmp_path / "seed"
    _seed_like(seed)
    for s in range(6):
        _run(seed, "aggressive", "sc_mis", s, k3=steep, rewards=[0.4] * N)
    v = {c.number: c for c in verdicts(_grid(seed))}
    assert v[3].verdict == "not distinguishable at n = 18 / 12", v[3].text
    assert "k3 growth (over the run, or before a collapse): 6/18 (aggressive/sc_mis/seed0" in v[3].text
    # The same pool at 2 seeds decides nothing.
    two = tmp_path / "two"
    for s in range(2):
        _run(two, "aggressive", "sc_mis", s, k3=steep, rewards=[0.4] * N)
        _run(two, "aggressive", "grpo", s, k3=[1e-3] * N, rewards=[0.4] * N)
    assert verdicts(_grid(two))[2].verdict == "not assessable at n = 2 / 2 (a verdict needs 3 runs a side)"


def test_a_corrected_collapse_counts_against_bounded_only_after_k3_growth(tmp_path):
    # SC + MIS collapsing on the homogeneous pool with k3 shrinking: the mismatch stayed bounded.
    _seed_like(tmp_path)
    shrink = [1e-3 * math.exp(-0.1 * s) for s in range(1, N + 1)]
    _run(tmp_path, "homogeneous", "sc_mis", 6, k3=shrink, rewards=[0.4] * 14 + [0.0] * (N - 14))
    v = {c.number: c for c in verdicts(_grid(tmp_path))}
    assert v[3].verdict == REPRODUCED, v[3].text
    assert "collapsed with k3 bounded or shrinking (not counted" in v[3].text and "homogeneous/sc_mis/seed6" in v[3].text
    assert "k3 growth (over the run, or before a collapse): 0/13" in v[3].text
    assert "Growth share, corrected: 0 / 13 = 0.00 [0.00, 0.23]; GRPO: 6 / 12" in v[3].text
    # The same collapse after k3 grew: counted against bounded, and the intervals now overlap.
    grown = tmp_path / "grown"
    _seed_like(grown)
    _run(grown, "mixed", "sc_mis", 6, k3=[1e-3 * math.exp(0.1 * s) for s in range(1, N + 1)],
         rewards=[0.4] * 14 + [0.0] * (N - 14))
    v = {c.number: c for c in verdicts(_grid(grown))}
    assert v[3].verdict == "not distinguishable at n = 13 / 12", v[3].text
    assert "k3 growth (over the run, or before a collapse): 1/13 (mixed/sc_mis/seed6" in v[3].text
    assert "+0.100/step before its collapse (growth)" in v[3].text
    assert "Growth share, corrected: 1 / 13 = 0.08 [0.01, 0.33]" in v[3].text


def test_claim_3_says_when_the_homogeneous_pools_corrected_runs_grew(tmp_path):
    """One sampler precision has no precision mismatch to bound: a corrected run whose k3 grew there
    is the policy drifting between sampling and training, and claim 3 says so, with the count."""
    grow = [1e-3 * math.exp(0.1 * s) for s in range(1, N + 1)]
    note = "On the homogeneous pool, with no precision mismatch, corrected runs grew too"
    texts = {}
    for pool, cond in (("homogeneous", "sc_mis"), ("mixed", "sc_mis"), ("homogeneous", "grpo")):
        root = tmp_path / f"{pool}_{cond}"
        _seed_like(root, seeds=range(3))
        for seed in (3, 4):  # two more seeds of one cell, whose k3 grew
            _run(root, pool, cond, seed, k3=grow, rewards=[0.4] * N)
        texts[(pool, cond)] = verdicts(_grid(root))[2].text
    assert f"{note} (2 / 5): k3 of trained samples includes the policy's drift" in texts[("homogeneous", "sc_mis")]
    # The same growth in the mixed pool's corrected runs, or in the homogeneous pool's uncorrected
    # ones, is not the drift note's case.
    assert "k3 growth (over the run, or before a collapse): 2/8 (mixed/sc_mis/seed3" in texts[("mixed", "sc_mis")]
    assert note not in texts[("mixed", "sc_mis")] and note not in texts[("homogeneous", "grpo")]
    assert "GRPO: 5 / 8" in texts[("homogeneous", "grpo")]  # the homogeneous GRPO growth counted as GRPO's


def _dial(root: Path, seeds=(0,), staleness=None) -> None:
    """Logit noise sigma 0.1 / 1 / 3: GRPO's k3 grows 0 / 5 / 15 %/step and collapses at sigma 3;
    SC + MIS flat at every sigma (same start). Every seed alike."""
    for seed in seeds:
        for sigma, rate in ((0.1, 0.0), (1.0, 0.05), (3.0, 0.15)):
            for cond in ("grpo", "sc_mis"):
                k3 = [1e-2 * sigma * math.exp((rate if cond == "grpo" else 0.0) * s) for s in range(1, N + 1)]
                falls = cond == "grpo" and sigma == 3.0
                _run(root, f"sigma{sigma}", cond, seed, k3=k3, rewards=[0.4] * 12 + [0.0] * 12 if falls else [0.4] * N,
                     sigma=sigma, group_k3={"a": 1.0}, staleness=staleness)


def test_report_has_growth_phase_and_claims(tmp_path):
    from experiments.report import write_report

    root = tmp_path / "dial"
    _dial(root, seeds=range(4))
    results = collect(root)
    assert sorted({r.sigma for r in results}) == [0.1, 1.0, 3.0]
    doc = write_report(root, tmp_path / "docs" / "results_dial.md", labels=LABELS, with_drift=False)
    text = doc.read_text()
    assert (tmp_path / "docs" / "results_dial" / "phase.png").stat().st_size > 1000
    assert "(results_dial/phase.png)" in text and "(results_dial/kl.png)" in text
    assert "## Growth of the mismatch: slope of ln k3" in text
    assert "| GRPO | sigma3.0 | 3 | 4/4 |" in text and "+0.1500" in text
    assert "## The seed's four claims (issue 20)" in text
    # Claim 2 from the dial alone: the collapsed runs grew; SC + MIS at the same sigma (same start) held.
    # Of the 20 runs that held only GRPO at sigma 1 grew: 4 / 4 [0.51, 1] lies above 4 / 20 [0.08, 0.42].
    assert "2. **Collapse follows unbounded growth of the mismatch, not its initial size — reproduced.**" in text
    assert "Growth share, collapsed: 4 / 4 = 1.00 [0.51, 1.00]; held: 4 / 20 = 0.20 [0.08, 0.42]" in text
    # The same dial at 3 seeds overlaps (3 / 3 [0.44, 1] vs 3 / 15 [0.07, 0.45]); at 2 it is not assessable.
    for n, verdict in ((3, "not distinguishable at n = 3 / 15"),
                       (2, "not assessable at n = 2 / 10 (a verdict needs 3 runs a side)")):
        fewer = Grid.of([r for r in results if r.seed < n], LABELS, {})
        assert verdicts(fewer)[1].verdict == verdict, verdicts(fewer)[1].text


def test_summary_document_and_readme_blocks(tmp_path):
    # The sync grid at the 2 seeds its sweep file plans (logged staleness 0), the dial at 4 (0.5).
    sync, dial = tmp_path / "sync", tmp_path / "dial"
    _seed_like(sync, seeds=range(2), staleness=0.0)
    _dial(dial, seeds=range(4), staleness=0.5)
    (sync / "warm_start").mkdir()
    (sync / "warm_start" / "seed0.json").write_text(json.dumps({"seed": 0, "wall_s": 90.0}))
    demo = []
    for i, (s1, e1) in enumerate(((0.2, 0.5), (0.25, 0.6), (0.2, 0.7))):
        d = tmp_path / f"demo{i}"
        d.mkdir()
        (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.1, "k3": 0.05, "out_of_range": 0.01}) + "\n")
        (d / "summary.json").write_text(json.dumps({"steps": 1,
            "eval_start": {"eval/pass@1": s1, "eval/pass@4": 0.6}, "eval_end": {"eval/pass@1": e1, "eval/pass@4": 0.8}}))
        demo.append(d)
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- results:begin -->\nold\n<!-- results:end -->\nmid\n<!-- demo:begin -->\nold\n<!-- demo:end -->\nend\n")
    sweeps = [
        load_sweep_runs("sync grid", ROOT / "configs" / "ablation_sync.yaml", sync, tmp_path / "docs" / "results_sync.md"),
        load_sweep_runs("dial grid", None, dial, None),
    ]
    probe_dir = tmp_path / "probe"
    _run(probe_dir, "mixed", "sc_mis", k3=[1e-3 * math.exp(0.3 * s) for s in range(1, N + 1)], rewards=[0.4] * N)
    probe = load_sweep_runs("lr probe", None, probe_dir, None, probe=True)
    probe.command = "mixrl-train sweep x.yaml optimizer.learning_rate=2e-3"
    sweeps.append(probe)
    doc = write_summary(sweeps, tmp_path / "docs" / "results.md", readme=readme, demo=demo,
                        extra_links=[("the asynchronous grid", "results_async.md")])
    text = doc.read_text()
    # 8 sync cells x 30 s + 90 s warm start + 24 dial cells x 30 s
    assert "Cell time used in all: **1080 s (18 min)**" in text  # + the probe's 30 s
    assert "### lr probe (probe: not in the claims below)" in text and "optimizer.learning_rate=2e-3" in text
    assert "corrected runs with k3 growth (over the run, or before a collapse): 0/16" in text  # the probe's growing run is not judged
    assert "cells finished: 8 of 18 planned" in text and "aggressive/grpo/seed0 (not run)" in text
    # Cells of 2 seeds and more: the decision table, before the claims it precedes.
    table = text.index("## Decision table (issue 48's pre-registered rules)")
    assert table < text.index("## The seed's four claims (issue 20)")
    assert "| mixed | GRPO | 2 | 0.300 [0.300, 0.300] | 2 / 2, 1.00 [0.34, 1.00] |" in text
    assert "| sigma3.0 | GRPO | 4 | 0.300 [0.300, 0.300] | 4 / 4, 1.00 [0.51, 1.00] |" in text
    assert "[results_sync.md](results_sync.md)" in text and "(results_async.md)" in text
    for fig in ("kl", "phase", "group_oor_vs_kl"):
        assert (tmp_path / "docs" / "results" / f"{fig}.png").stat().st_size > 1000 and f"(results/{fig}.png)" in text
    # Claims 2-4 pool the dial's 4 seeds with the sync grid's 2; claim 1 compares two sync cells of 2.
    assert text.count("— reproduced.**") == 3
    assert "ones — not assessable at n = 2 / 2 (a verdict needs 3 runs a side).**" in text
    r = readme.read_text()
    assert r.startswith("intro\n<!-- results:begin -->\n") and "old" not in r and r.endswith("end\n")
    assert "sync grid: 8/18 cells (seed 0, 1), 24 RL steps, synchronous;" in r
    assert "dial grid: 24/24 cells (seed 0, 1, 2, 3), 24 RL steps, asynchronous, mean staleness 0.50;" in r
    assert r.count("**reproduced**") == 3 and "**not assessable at n = 2 / 2 (a verdict needs 3 runs a side)**" in r
    assert "0.500 / 0.600 / 0.700" in r and "3/3 runs met the demo's bar" in r and "| 1 | 0.200 → 0.500 | 0.600 → 0.800 | 0.050 | 0.0100 |" in r


def test_finish_command_drops_the_subset():
    cmd = "mixrl-train sweep configs/ablation_sync.yaml --out runs/a --pools mixed,homogeneous --seeds 0 --conditions=grpo run.steps=24"
    assert finish_command(cmd) == "mixrl-train sweep configs/ablation_sync.yaml --out runs/a run.steps=24"


def _one_sweep(root: Path, seeds, staleness=None, command=None, planned=()):
    """A sweep of GRPO on two pools, its summary document rendered without figures."""
    from experiments.report.summary import render_summary

    for seed in seeds:
        for pool in ("mixed", "homogeneous"):
            _run(root, pool, "grpo", seed, k3=[1e-3] * N, rewards=[0.4] * N,
                 staleness=staleness(seed) if callable(staleness) else staleness)
    if command:
        (root / "sweep.json").write_text(json.dumps({"command": command, "out": str(root)}))
    sweep = load_sweep_runs("x grid", None, root, None)
    sweep.planned = list(planned)
    grid = Grid.of(sweep.results, LABELS, {})
    return sweep, grid, render_summary([sweep], root.parent / "results.md", {}, grid, [])


def test_an_archived_nice_command_finishes_the_grid(tmp_path):
    cmd = ("nice -n 19 .venv/bin/mixrl-train sweep configs/x.yaml --no-report --conditions grpo,sc_mis "
           "(in progress: resumable; python -m experiments.report.archive --restore docs/x runs/x continues it)")
    planned = [(p, c, 0) for p in ("mixed", "homogeneous") for c in ("grpo", "sc_mis")]
    _, _, text = _one_sweep(tmp_path / "x", [0], command=cmd, planned=planned)
    assert "- **not finished** (2): mixed/sc_mis/seed0 (not run), homogeneous/sc_mis/seed0 (not run)" in text
    # The whole grid: the subset and the note dropped, the nice prefix and the venv's path kept.
    assert ("- to finish the grid (finished cells are skipped): "
            "`nice -n 19 .venv/bin/mixrl-train sweep configs/x.yaml --no-report`") in text


def test_decision_table_only_with_two_seeds_in_a_cell(tmp_path):
    _, _, one = _one_sweep(tmp_path / "one", [0])
    assert "## The seed's four claims (issue 20)" in one and "Decision table" not in one
    _, _, two = _one_sweep(tmp_path / "two", [0, 1])
    assert "## Decision table (issue 48's pre-registered rules)" in two
    assert "| mixed | GRPO | 2 | 0.300 [0.300, 0.300] | 0 / 2, 0.00 [0.00, 0.66] |" in two
    assert "- mixed vs homogeneous, GRPO: final pass@1: not assessable at n = 2 / 2" in two


def test_readme_names_each_grids_mode(tmp_path):
    from experiments.report.summary import readme_results

    readme = tmp_path / "README.md"
    for name, staleness, mode in (
        ("sync", 0.0, "synchronous"),
        ("async", lambda seed: 1.0 + seed, "asynchronous, mean staleness 1.50"),  # runs of 1 and 2 steps stale
        ("unlogged", None, "–"),
    ):
        sweep, grid, _ = _one_sweep(tmp_path / name, [0, 1], staleness=staleness)
        block = readme_results([sweep], grid, tmp_path / "docs" / "results.md", readme)
        assert f"x grid: 4/4 cells (seed 0, 1), 24 RL steps, {mode};" in block, block


def test_an_archived_command_is_printed_as_it_runs_now(tmp_path):
    """A sweep.json keeps the command as it ran (history); the reports print the command to run
    today: the report's modules moved from trainer_jax.report to experiments.report (issue 47)."""
    from experiments.report import write_report

    old = ("nice -n 19 mixrl-train sweep configs/ablation_dial.yaml --no-report (in progress: resumable; "
           "python -m trainer_jax.report.archive --restore docs/results_dial runs/ablation_dial continues it)")
    root = tmp_path / "dial"
    _dial(root)
    (root / "sweep.json").write_text(json.dumps({"command": old, "sweep_file": "configs/ablation_dial.yaml",
                                                 "out": str(root), "seeds": [0]}))
    report = write_report(root, tmp_path / "docs" / "results_dial.md", labels=LABELS, with_drift=False)
    summary = write_summary([load_sweep_runs("dial grid", None, root, None)], tmp_path / "docs" / "results.md")
    new = old.replace("-m trainer_jax.report.archive", "-m experiments.report.archive")
    for text in (report.read_text(), summary.read_text()):
        assert f"command: `{new}`" in text and "trainer_jax.report" not in text
    assert json.loads((root / "sweep.json").read_text())["command"] == old  # the record stays as it was


def test_held_out_collapse_counts_without_a_reward_collapse(tmp_path):
    # Rewards of a few hundredths (chain's partial credit) never clear the reward floor; held-out
    # pass@1 falling from 0.2 to 0.05 is a collapse all the same, seen at the end of the run.
    small = [0.04] * N
    for seed in range(4):
        _run(tmp_path, "mixed", "grpo", seed, k3=[1e-3] * N, rewards=small, eval_end=0.05)
        _run(tmp_path, "homogeneous", "grpo", seed, k3=[1e-3] * N, rewards=small)
    results = {r.pool: r for r in collect(tmp_path) if r.seed == 0}
    assert results["mixed"].eval_collapsed and results["mixed"].collapse_step is None
    assert not results["homogeneous"].collapsed
    v = {c.number: c for c in verdicts(_grid(tmp_path))}
    # 4 / 4 [0.51, 1] against 0 / 4 [0, 0.49]; a held-out collapse counts at the run's last step.
    assert v[1].verdict == REPRODUCED, v[1].text
    assert "GRPO / mixed: collapsed 4 / 4 = 1.00 [0.51, 1.00], final held-out pass@1 0.050 [0.050, 0.050]" in v[1].text
    assert "GRPO / homogeneous: collapsed 0 / 4 = 0.00 [0.00, 0.49]" in v[1].text and "24.0 vs 25.0" in v[1].text
    assert "mixed/grpo/seed0: k3 first 2 steps 1.00e-03, slope before collapse +0.000/step (bounded), held-out pass@1 0.200 → 0.050" in v[2].text
    # The collapse came with no k3 growth over the run: claim 2 is not shown (0 / 4 grew, as did 0 / 4 that held).
    assert v[2].verdict == "not distinguishable at n = 4 / 4", v[2].text
    assert "Growth share, collapsed: 0 / 4 = 0.00 [0.00, 0.49]; held: 0 / 4 = 0.00 [0.00, 0.49]" in v[2].text
    # Where the runs that held grew and the collapsed ones did not, the rule says the opposite.
    grew = tmp_path / "grew"
    for seed in range(4):
        _run(grew, "mixed", "grpo", seed, k3=[1e-3] * N, rewards=small, eval_end=0.05)
        _run(grew, "homogeneous", "grpo", seed, k3=[1e-3 * math.exp(0.1 * s) for s in range(1, N + 1)], rewards=small)
    assert verdicts(_grid(grew))[1].verdict == NOT_REPRODUCED
    # The same split at 2 seeds: not assessable.
    two = _grid(tmp_path)
    two = Grid.of([r for r in two.results if r.seed < 2], LABELS, {})
    assert verdicts(two)[0].verdict == "not assessable at n = 2 / 2 (a verdict needs 3 runs a side)"


def _claim_4_pools(root: Path, seeds) -> None:
    # Four bf16 groups (configs/local_homogeneous.yaml) whose k3 differ by noise: not a test of claim 4,
    # however the out-of-range tokens fall; the mixed pool's recipes differ and are judged.
    homog = {"bf16-a": 0.5, "bf16-b": 1.0, "bf16-c": 1.0, "bf16-d": 2.0}
    mixed = {"bf16": 0.5, "fp8": 1.0, "nvfp4": 3.0, "mxfp4": 1.0}
    for seed in seeds:
        _run(root, "homogeneous", "grpo", seed, k3=[1e-3] * N, rewards=[0.4] * N, group_k3=homog,
             group_oor={"bf16-a": 0.01, "bf16-b": 0.0, "bf16-c": 0.0, "bf16-d": 0.0},
             config=str(ROOT / "configs" / "local_homogeneous.yaml"))
        _run(root, "mixed", "grpo", seed, k3=[1e-3] * N, rewards=[0.4] * N, group_k3=mixed,
             group_oor={"bf16": 0.0, "fp8": 0.001, "nvfp4": 0.02, "mxfp4": 0.002},
             config=str(ROOT / "configs" / "local_mixed.yaml"))


def test_claim_4_judges_only_pools_whose_groups_differ(tmp_path):
    _claim_4_pools(tmp_path, range(3))
    results = {r.pool: r for r in collect(tmp_path) if r.seed == 0}
    assert results["mixed"].group_recipes["nvfp4"].startswith("nvfp4_w4a4/kv=fp8_e4m3")
    c4 = verdicts(_grid(tmp_path))[3]
    # nvfp4: 0.02 / 0.023 of the out-of-range tokens from a quarter of the policy tokens, every run alike.
    assert c4.verdict == REPRODUCED and "Not judged (all groups of one recipe): homogeneous" in c4.text
    assert "largest-KL group `nvfp4`" in c4.text and "per run 3.48 [3.48, 3.48]x, n = 3" in c4.text
    # Claim 4 counts the judged pool's runs: 2 are too few.
    two = tmp_path / "two"
    _claim_4_pools(two, range(2))
    c4 = verdicts(_grid(two))[3]
    assert c4.verdict == "not assessable at n = 2 (a verdict needs 3 runs)", c4.text
