"""The ablation sweep and its report.

Fast: the sweep file parses into the 6 x 2 grid, a failing cell is recorded and not fatal, and the
report generator turns synthetic run directories into tables, curves, attribution and conclusions
that follow the numbers. End to end: the real ``--quick`` grid (a warm start and 4 short training
runs with real sampler processes, ~3.5 min on the 2-core machine), the CI smoke test of the sweep.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.report import collapse_step, collect, group_attribution, write_report
from experiments.sweep import Cell, load_sweep, run_cell

ROOT = Path(__file__).resolve().parents[2]
ABLATION = ROOT / "configs" / "ablation.yaml"
BIN = Path(sys.executable).parent


def test_ablation_file_is_the_issue_grid():
    spec = load_sweep(ABLATION)
    assert set(spec.pools) == {"mixed", "homogeneous"}
    assert list(spec.conditions) == ["grpo", "grpo_mis", "sc", "grpo_topp", "sc_mis", "sc_mis_topp"]
    for cond in spec.conditions.values():
        # Every condition pins every knob, so none inherits the base config's corrected objective.
        keys = {o.split("=")[0] for o in cond.overrides}
        assert {
            "objective.is_mode",
            "objective.score_centering",
            "objective.top_p_replay",
            "tasks.sampling.top_p",
        } <= keys
    grpo = dict(o.split("=") for o in spec.conditions["grpo"].overrides)
    assert grpo == {
        "objective.is_mode": "none",
        "objective.score_centering": "false",
        "objective.top_p_replay": "false",
        "tasks.sampling.top_p": "1.0",
    }
    top = dict(o.split("=") for o in spec.conditions["sc_mis_topp"].overrides)
    assert top["objective.top_p_replay"] == "true" and float(top["tasks.sampling.top_p"]) < 1
    quick = spec.select(quick=True)
    assert len(quick.conditions) * len(quick.pools) * len(quick.seeds) == 4
    assert "run.steps=2" in quick.overrides


def test_pools_differ_only_in_their_sampler_groups():
    """The mixed/homogeneous comparison is only fair if nothing but the groups differs.

    A larger trajectory buffer in one pool once let its samplers run further ahead of the learner
    (mean staleness 3.3 versions against 1.8), which made the all-bf16 pool look *worse* than the
    mixed one for a reason unrelated to precision.
    """
    from trainer_jax.config import load_config

    spec = load_sweep(ABLATION)
    dumps = {}
    for pool, path in spec.pools.items():
        cfg = load_config(path, list(spec.overrides)).model_dump()
        dumps[pool] = (cfg.pop("groups"), cfg.pop("run"), cfg)
    (mixed_groups, mixed_run, mixed), (homog_groups, homog_run, homog) = dumps["mixed"], dumps["homogeneous"]
    assert mixed == homog
    assert {k: v for k, v in mixed_run.items() if k not in ("name", "dir")} == {
        k: v for k, v in homog_run.items() if k not in ("name", "dir")
    }
    assert len(mixed_groups) == len(homog_groups)
    assert [g["capacity"] for g in mixed_groups] == [g["capacity"] for g in homog_groups]
    assert {g["recipe"] for g in homog_groups} == {"bf16"}
    assert {g["kv_cache_dtype"] for g in homog_groups} == {"bf16"}
    assert len({g["recipe"] for g in mixed_groups}) == len(mixed_groups)


def test_bad_sweep_file_fails_up_front(tmp_path):
    from experiments.sweep import SweepError

    bad = tmp_path / "s.yaml"
    bad.write_text(
        f"pools: {{mixed: {ROOT / 'configs/local_mixed.yaml'}}}\n"
        "conditions: {x: [objective.is_mode=bogus_mode]}\n"
    )
    with pytest.raises(SweepError, match="condition x"):
        load_sweep(bad)


def test_shared_warm_start_is_one_for_every_seed(tmp_path):
    from experiments.sweep import SweepError, cells, warm_start_seeds

    base = (f"pools: {{mixed: {ROOT / 'configs/local_mixed.yaml'}}}\n"
            "conditions: {grpo: [objective.is_mode=none], mis: [objective.is_mode=mis]}\nseeds: [0, 1, 2]\n")
    f = tmp_path / "s.yaml"
    f.write_text(base + "warm_start: shared\nwarm_start_seed: 7\n")
    spec = load_sweep(f)
    assert warm_start_seeds(spec) == [7]
    grid = cells(spec, tmp_path / "out")
    assert len(grid) == 6 and {c.seed for c in grid} == {0, 1, 2}
    warm = {o for c in grid for o in c.overrides if o.startswith("model.hf_dir=")}
    assert warm == {f"model.hf_dir={tmp_path / 'out' / 'warm_start' / 'seed7'}"}
    assert all(f"run.seed={c.seed}" in c.overrides for c in grid)  # seeds still vary the RL part
    f.write_text(base + "warm_start: shared\n")
    assert warm_start_seeds(load_sweep(f)) == [0]
    f.write_text(base)  # the default: one warm start per seed
    spec = load_sweep(f)
    assert warm_start_seeds(spec) == [0, 1, 2]
    assert {o for c in cells(spec, tmp_path) for o in c.overrides if o.startswith("model.hf_dir=")} == {
        f"model.hf_dir={tmp_path / 'warm_start' / f'seed{s}'}" for s in (0, 1, 2)}
    f.write_text(base + "warm_start: false\n")
    assert warm_start_seeds(load_sweep(f)) == []
    for bad, message in (("warm_start: sometimes\n", "true, false or 'shared'"),
                         ("warm_start: true\nwarm_start_seed: 1\n", "goes with warm_start: shared"),
                         ("warm_start: shared\nwarm_start_seed: one\n", "must be an integer")):
        f.write_text(base + bad)
        with pytest.raises(SweepError, match=message):
            load_sweep(f)


def test_learning_rate_pick_is_the_control_under_grpo_at_three_rates():
    """configs/ablation_decide_lr.yaml (issue 48): GRPO and SC + MIS cells differ only in the rate."""
    from experiments.sweep import warm_start_seeds

    spec = load_sweep(ROOT / "configs" / "ablation_decide_lr.yaml")
    assert list(spec.pools) == ["homogeneous"] and spec.seeds == [0, 1] and warm_start_seeds(spec) == [0]
    rates: dict[tuple[str, ...], list[float]] = {}
    for cond in spec.conditions.values():
        rest = tuple(o for o in cond.overrides if not o.startswith("optimizer.learning_rate="))
        rate = next(o for o in cond.overrides if o.startswith("optimizer.learning_rate=")).split("=")[1]
        rates.setdefault(rest, []).append(float(rate))
    grpo = ("objective.is_mode=none", "objective.score_centering=false", "objective.top_p_replay=false")
    sc_mis = ("objective.is_mode=mis", "objective.score_centering=true", "objective.top_p_replay=false")
    assert {k: sorted(v) for k, v in rates.items()} == {grpo: [5e-4, 1e-3, 2e-3], sc_mis: [5e-4, 1e-3]}


def test_decision_grid_evaluates_every_pool_through_a_clean_bf16_group():
    """configs/ablation_decide.yaml (issue 48): 6 seeds from one warm start; every pool evaluates
    through an eval-only bf16 group with no dial; the pools differ only in their training groups;
    the dial pool rounds every training group's weights; the conditions are the issue's."""
    from experiments.sweep import warm_start_seeds
    from trainer_jax.config import load_config

    spec = load_sweep(ROOT / "configs" / "ablation_decide.yaml")
    assert len(spec.seeds) >= 6 and warm_start_seeds(spec) == [0]
    assert list(spec.conditions)[:3] == ["grpo", "sc_mis", "geo_mask"]
    rest = {}
    for pool in ("homogeneous", "mixed", "dial"):
        cfg = load_config(spec.pools[pool], [*spec.overrides, *spec.pool_overrides[pool]])
        (ev,) = [g for g in cfg.groups if g.eval_only]
        assert cfg.eval_group == ev.name and ev.recipe == "bf16" and ev.round_weights is None
        assert not ev.logit_noise and ev.kv_cache_dtype in (None, "bf16")
        training = [g for g in cfg.groups if not g.eval_only]
        assert len(training) == 4
        if pool == "dial":
            assert {(g.recipe, g.round_weights.bits) for g in training} == {("bf16", 2)}
        dump = cfg.model_dump()
        dump.pop("groups"), dump.pop("run")
        rest[pool] = dump
    assert rest["homogeneous"] == rest["mixed"] == rest["dial"]


def test_failed_cell_is_recorded_not_fatal(tmp_path):
    # A long directory name: the error must still be one line naming the file (not wrapped).
    cell = Cell("mixed", "grpo", 0, tmp_path / ("d" * 90) / "missing.yaml", ("run.steps=1",),
                tmp_path / "run")
    record = run_cell(cell, timeout=120)
    assert record["ok"] is False and record["returncode"] == 2
    saved = json.loads((tmp_path / "run" / "cell.json").read_text())
    assert saved["ok"] is False
    assert any(line.startswith("error: config file") and line.endswith("missing.yaml does not exist")
               for line in saved["log_tail"].splitlines()), saved["log_tail"]


# ------------------------------------------------------------------ report on synthetic runs


def _write_run(
    root: Path,
    pool: str,
    cond: str,
    seed: int,
    *,
    rewards,
    k3,
    oor_by_group,
    eval_end,
    groups=("bf16", "fp8"),
) -> None:
    run = root / pool / cond / f"seed{seed}"
    run.mkdir(parents=True)
    lines = [json.dumps({"step": -1, "sft/loss": 1.0})]
    for s, (r, k) in enumerate(zip(rewards, k3, strict=True), 1):
        rec = {
            "step": s,
            "loss": 0.1,
            "grad_norm": 0.5 * s,
            "reward_mean": r,
            "pass_rate": r,
            "k3": k,
            "entropy": 2.0 - 0.01 * s,
            "out_of_range": sum(oor_by_group.values()) / len(groups),
            "samples_trained": 8,
        }
        for g in groups:
            rec[f"group/{g}/tokens"] = 100.0
            rec[f"group/{g}/out_of_range"] = oor_by_group[g]
            rec[f"group/{g}/k3"] = k * (3.0 if g == "fp8" else 0.5)
            rec[f"group/{g}/sample_share"] = 1 / len(groups)
        lines.append(json.dumps(rec))
    lines.append(json.dumps({"step": len(rewards), "eval/pass@1": eval_end, "eval/pass@4": eval_end}))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run / "summary.json").write_text(
        json.dumps({"eval_start": {"eval/pass@1": 0.3}, "eval_end": {"eval/pass@1": eval_end}})
    )
    (run / "cell.json").write_text(json.dumps({"ok": True, "wall_s": 12.0, "returncode": 0}))


def _synthetic(root: Path, *, grpo_collapses: bool) -> None:
    n = 20
    flat = [0.5] * n
    falling = [0.5] * 8 + [0.0] * (n - 8)
    for pool, k3 in (("mixed", 4e-3), ("homogeneous", 1e-3)):
        oor = {"bf16": 0.0, "fp8": 0.02} if pool == "mixed" else {"bf16": 0.0, "fp8": 0.0}
        _write_run(
            root,
            pool,
            "grpo",
            0,
            rewards=falling if grpo_collapses and pool == "mixed" else flat,
            k3=[k3] * n,
            oor_by_group=oor,
            eval_end=0.0 if grpo_collapses and pool == "mixed" else 0.5,
        )
        _write_run(root, pool, "sc_mis", 0, rewards=flat, k3=[k3] * n, oor_by_group=oor, eval_end=0.5)
    # A failed cell: recorded in the report, not an exception.
    bad = root / "mixed" / "sc" / "seed0"
    bad.mkdir(parents=True)
    (bad / "cell.json").write_text(json.dumps({"ok": False, "returncode": 1, "log_tail": "boom: it broke"}))
    (root / "sweep.json").write_text(
        json.dumps(
            {
                "command": "mixrl-train sweep configs/ablation.yaml",
                "wall_s_total": 123.0,
                "seeds": [0],
                "overrides": ["run.steps=20"],
                "finished_utc": "2026-01-01 00:00:00",
                "conditions": {
                    "grpo": {"label": "GRPO", "overrides": ["objective.is_mode=none"]},
                    "sc_mis": {"label": "SC + MIS", "overrides": ["objective.is_mode=mis"]},
                    "sc": {"label": "SC", "overrides": []},
                },
            }
        )
    )


def test_collapse_detection():
    recs = [{"step": s, "reward_mean": r, "k3": 1e-3} for s, r in enumerate([0.5] * 8 + [0.0] * 12, 1)]
    step, reason, kl = collapse_step(recs)
    assert step is not None and 9 <= step <= 14 and reason and kl is None
    flat = [{"step": s, "reward_mean": 0.5, "k3": 1e-3} for s in range(1, 21)]
    assert collapse_step(flat)[0] is None
    growing = [{"step": s, "reward_mean": 0.5, "k3": 1e-3 * (1 if s <= 5 else 10)} for s in range(1, 21)]
    assert collapse_step(growing)[2] is not None
    # A dip the run recovers from is not a collapse; the same dip at the end is.
    dip = [0.5] * 8 + [0.0] * 6 + [0.5] * 6
    assert collapse_step([{"step": s, "reward_mean": r} for s, r in enumerate(dip, 1)])[0] is None
    late = [0.5] * 12 + [0.0] * 8
    assert collapse_step([{"step": s, "reward_mean": r} for s, r in enumerate(late, 1)])[0] >= 13
    last_step_dip = [0.5] * 19 + [0.0]
    assert collapse_step([{"step": s, "reward_mean": r} for s, r in enumerate(last_step_dip, 1)])[0] is None
    # k3 jumps once the first stale batches arrive (step 5 here) and then stays level: with the
    # baseline taken after the settling steps, as the trainer does, that is not a KL blow-up.
    settling = [{"step": s, "reward_mean": 0.5, "k3": 1e-4 if s < 5 else 1e-1} for s in range(1, 41)]
    assert collapse_step(settling)[2] is not None
    assert collapse_step(settling, settle_steps=10)[2] is None


def test_group_attribution_shares():
    recs = [
        {
            "step": 1,
            "samples_trained": 10,
            "group/a/sample_share": 0.9,
            "group/b/sample_share": 0.1,
            "group/a/tokens": 90.0,
            "group/b/tokens": 10.0,
            "group/a/out_of_range": 0.01,
            "group/b/out_of_range": 0.1,
            "group/a/k3": 1e-3,
            "group/b/k3": 1e-2,
        }
    ]
    att = group_attribution(recs)
    assert math.isclose(att["b"]["sample_share"], 0.1)
    # b: 1 of 1.9 out-of-range tokens; a: 0.9 of 1.9
    assert math.isclose(att["b"]["oor_share"], 1.0 / 1.9)
    assert math.isclose(att["b"]["k3"], 1e-2)


@pytest.mark.parametrize("collapses", [True, False])
def test_report_from_synthetic_runs(tmp_path, collapses):
    root = tmp_path / "sweep"
    _synthetic(root, grpo_collapses=collapses)
    results = collect(root)
    assert len(results) == 5 and sum(not r.ok for r in results) == 1
    doc = write_report(root, tmp_path / "docs" / "results.md", with_drift=False)
    text = doc.read_text()
    for name in ("reward", "kl", "grad_norm", "entropy", "out_of_range"):
        assert (tmp_path / "docs" / "results" / f"{name}.png").stat().st_size > 1000
        assert f"(results/{name}.png)" in text
    assert "mixrl-train sweep configs/ablation.yaml" in text and "run time of the grid: 48 s" in text
    assert "Failed cells" in text and "boom" in text
    assert "| GRPO | mixed | 1/1 |" in text and "| SC + MIS | homogeneous | 1/1 |" in text
    # The KL ratio mixed/homogeneous is computed from the runs (4e-3 / 1e-3).
    assert "| 4.00 |" in text and "4.0x the homogeneous" in text
    # Attribution: fp8 has half the samples, half the policy tokens and all the out-of-range tokens.
    assert "| fp8 | 0.500 | 0.500 | 1.000 |" in text and "| 2.00 |" in text
    if collapses:
        assert "reproduced** in 1/1 seeds" in text
    else:
        assert "not reproduced at this scale" in text
    assert "SC + MIS (+ top-p replay) stays stable on the mixed pool — held" in text


def test_report_names_a_collapse_of_uncorrected_top_p(tmp_path):
    root = tmp_path / "sweep"
    _synthetic(root, grpo_collapses=False)
    oor = {"bf16": 0.0, "fp8": 0.02}
    _write_run(root, "mixed", "grpo_topp", 0, rewards=[0.5] * 8 + [0.0] * 12, k3=[1e-2] * 20,
               oor_by_group=oor, eval_end=0.0)
    _write_run(root, "mixed", "sc_mis_topp", 0, rewards=[0.5] * 20, k3=[1e-2] * 20, oor_by_group=oor,
               eval_end=0.4)
    text = write_report(root, tmp_path / "results.md", with_drift=False).read_text()
    assert "Where the mismatch is large by construction it does reproduce" in text
    assert "collapsed in 1/1 seeds on the mixed pool" in text and "mask replay collapsed in 0/1" in text
    # Without the uncorrected top-p collapse the sentence is not written.
    plain = tmp_path / "plain"
    _synthetic(plain, grpo_collapses=False)
    plain_text = write_report(plain, tmp_path / "r3.md", with_drift=False).read_text()
    assert "large by construction" not in plain_text


def test_report_without_drift_does_not_load_jax():
    # Only the drift analysis needs JAX; writing a report with_drift=False must not pay its import.
    code = "import sys, experiments.report; assert 'jax' not in sys.modules, 'jax imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]


# ------------------------------------------------------------------ the real quick grid


# ~4 min: the grid's sweep / report machinery end to end. CI runs the sync-mode dial sweep
# (tests/trainer/test_sync.py), which goes through the same sweep, warm-start sharing and report.
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_quick_sweep_end_to_end(tmp_path):
    out, doc = tmp_path / "runs", tmp_path / "results.md"
    proc = subprocess.run(
        [BIN / "mixrl-train", "sweep", str(ABLATION), "--quick", "--out", str(out), "--report", str(doc)],
        capture_output=True,
        text=True,
        timeout=1400,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = json.loads((out / "sweep.json").read_text())
    assert len(manifest["cells"]) == 4 and all(c["ok"] for c in manifest["cells"])
    for pool in ("mixed", "homogeneous"):
        for cond in ("grpo", "sc_mis_topp"):
            run = out / pool / cond / "seed0"
            steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            assert [r["step"] for r in steps if "loss" in r] == [1, 2]
            assert (run / "trajectories.pkl").exists()
    text = doc.read_text()
    assert "| GRPO | mixed | 1/1 |" in text and "Drift on real sampler outputs" in text
    drift = json.loads((out / "mixed" / "grpo" / "seed0" / "drift.json").read_text())
    # SC removes the drift term: the SC gradient differs from the uncorrected one by exactly it.
    assert drift["batch"]["drift"] > 0


def test_a_sweep_file_is_read_with_the_configs_bounds(tmp_path):
    """An alias bomb or a duplicate key in a sweep file is one SweepError line, like a config's."""
    from experiments.sweep import SweepError

    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
        for p, c in zip("abcdefgh", "bcdefghi", strict=True)) + "pools: *i\n")
    with pytest.raises(SweepError, match="alias"):
        load_sweep(bomb)
    dup = tmp_path / "dup.yaml"
    dup.write_text(f"pools: {{mixed: {ROOT / 'configs/local_mixed.yaml'}}}\nconditions: {{x: []}}\n"
                   "seeds: [0]\nseeds: [1]\n")
    with pytest.raises(SweepError, match="seeds"):
        load_sweep(dup)
