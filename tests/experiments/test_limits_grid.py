"""The planner's default limits from issue 48's grid (issue 48 item 5, experiments/report/limits_grid.py):
a synthetic archive whose verdicts and mismatch figures are set by hand and recomputed here from the
numbers written, and the committed default file against what the command writes from the real archive."""

from __future__ import annotations

import gzip
import json
import shlex
from pathlib import Path

import pytest
import yaml

from experiments.plan_solve import load_limits
from experiments.report.intervals import cell_outcome, overlap
from experiments.report.limits_grid import eval_only_groups, limits_document, main, parser, render
from experiments.report.runs import RunResult

ROOT = Path(__file__).parent.parent.parent
CONFIG = ROOT / "configs" / "local_homogeneous.yaml"
STEPS = 40  # the planner measures the last half: steps 21-40
EVAL = "ev"  # every pool's evaluation-only group
SEEDS = 4

# Per pool: final held-out pass@1 per seed (start 0.3 everywhere), the seeds whose reward collapses,
# and per training group its (probe KL, out-of-range share) per seed over the last half of the run.
# The first half carries 10x the probe KL and +0.05 out of range: a measure over the whole run is wrong.
# Group names are chosen so that neither the first name nor the lowest share is the reference.
POOLS = {
    "homogeneous": {  # the control
        "finals": [0.50, 0.52, 0.48, 0.51], "reward_collapse": [],
        "groups": {"b": ([2e-4] * 4, [0.011] * 4), "a": ([1e-4] * 4, [0.010, 0.012, 0.010, 0.010])},
        "eval": (1e-7, 0.0),
    },
    "mixed": {  # within; its worst-KL group (m-nvfp4) is not its worst-added-share group (q-int4)
        "finals": [0.49, 0.51, 0.50, 0.52], "reward_collapse": [],
        "groups": {
            "a-fp8": ([5e-3] * 4, [0.008] * 4),  # the lowest share: not the reference
            "m-nvfp4": ([0.01, 0.01, 0.01, 0.09], [0.014] * 4),  # mean 0.03, max 0.09
            "q-int4": ([0.02] * 4, [0.030, 0.030, 0.030, 0.010]),  # mean 0.025: adds 0.013 (max: 0.018)
            "z-bf16": ([1e-4] * 4, [0.012] * 4),  # the lowest probe KL: the reference
        },
        # evaluation-only: the lowest probe KL and no share; as the reference it would add 0.025
        "eval": (1e-7, 0.0),
    },
    "wild": {  # within though one seed's held-out pass@1 collapsed (0.3 -> 0.1)
        "finals": [0.50, 0.52, 0.49, 0.10], "reward_collapse": [],
        "groups": {"x": ([0.04, 0.04, 0.04, 0.16], [0.02] * 4), "y": ([1e-4] * 4, [0.019] * 4)},
        # evaluation-only by its config, though its metrics carry trained tokens: its KL is no limit
        "eval": (5.0, 0.5), "eval_trains": True,
    },
    "crash": {  # pass@1 like the control's, but every seed's reward collapses: not within
        "finals": [0.50, 0.51, 0.50, 0.49], "reward_collapse": [0, 1, 2, 3],
        "groups": {"c": ([0.2] * 4, [0.08] * 4), "d": ([1e-4] * 4, [0.01] * 4)},
        "eval": (1e-7, 0.0),
    },
    "far": {  # pass@1 interval disjoint from the control's: not within
        "finals": [0.20, 0.22, 0.18, 0.21], "reward_collapse": [],
        "groups": {"e": ([0.5] * 4, [0.2] * 4), "f": ([1e-4] * 4, [0.01] * 4)},
        "eval": (1e-7, 0.0),
    },
    "few": {  # two seeds: not assessable
        "finals": [0.50, 0.51], "reward_collapse": [],
        "groups": {"g": ([0.9] * 2, [0.5] * 2), "h": ([1e-4] * 2, [0.01] * 2)},
        "eval": (1e-7, 0.0),
    },
}


def _groups_override(names: list[str]) -> str:
    groups = [f"{{name: {g}, recipe: bf16, capacity: 8, device: cpu}}" for g in names]
    groups.append(f"{{name: {EVAL}, recipe: bf16, capacity: 8, device: cpu, eval_only: true}}")
    return f"groups=[{', '.join(groups)}]"


def write_cell(out: Path, pool: str, cond: str, seed: int, spec: dict, scale: float = 1.0) -> None:
    """One archived cell (metrics.jsonl.gz, summary.json, cell.json) as report.archive keeps it."""
    d = out / pool / cond / f"seed{seed}"
    d.mkdir(parents=True)
    groups = spec["groups"]
    rows = [{"step": 0, "eval/pass@1": 0.3}]
    for s in range(1, STEPS + 1):
        late = s > STEPS // 2
        reward = 0.0 if seed in spec["reward_collapse"] and late else 0.4
        row = {"step": s, "loss": 0.1, "reward_mean": reward, "k3": 0.01, "samples_trained": 100.0}
        for g, (kl, oor) in groups.items():
            k, o = kl[seed] * scale, oor[seed] * scale
            row.update({f"group/{g}/probe_kl": k if late else 10 * k, f"group/{g}/tokens": 100.0,
                        f"group/{g}/out_of_range": o if late else o + 0.05,
                        f"group/{g}/sample_share": 1 / len(groups)})
        kl, oor = spec["eval"]
        trains = spec.get("eval_trains", False)
        row.update({f"group/{EVAL}/probe_kl": kl, f"group/{EVAL}/out_of_range": oor,
                    f"group/{EVAL}/tokens": 100.0 if trains else 0.0,
                    f"group/{EVAL}/sample_share": 0.1 if trains else 0.0})
        rows.append(row)
    rows.append({"step": STEPS, "eval/pass@1": spec["finals"][seed]})
    (d / "metrics.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    (d / "summary.json").write_text(json.dumps({"eval_start": {"eval/pass@1": 0.3},
                                                "eval_end": {"eval/pass@1": spec["finals"][seed]},
                                                "steps": STEPS}))
    command = [".venv/bin/mixrl-train", "--config", str(CONFIG), "--run-dir", str(d),
               _groups_override(list(groups)), f"train.eval_group={EVAL}"]
    (d / "cell.json").write_text(json.dumps({"pool": pool, "condition": cond, "seed": seed, "ok": True,
                                             "command": command}))


def write_sweep(path: Path, pools: list[str]) -> Path:
    path.write_text(yaml.safe_dump({
        "pools": {p: str(CONFIG) for p in pools},
        "conditions": {"grpo": {"label": "GRPO", "overrides": ["objective.is_mode=none"]},
                       "sc_mis": {"label": "SC + MIS", "overrides": ["objective.is_mode=mis"]},
                       "geo_mask": {"label": "geo_mask", "overrides": ["objective.is_mode=geo_mask"]}},
        "seeds": list(range(6)),
    }, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """The pools above under SC + MIS; under geo_mask the control and mixed with 3x mixed's figures
    (within: the default must not take them); under GRPO far with 100x (uncorrected: ignored)."""
    root = tmp_path_factory.mktemp("grid")
    archive = root / "archive"
    for pool, spec in POOLS.items():
        for seed in range(len(spec["finals"])):
            write_cell(archive, pool, "sc_mis", seed, spec)
    for seed in range(SEEDS):
        write_cell(archive, "homogeneous", "geo_mask", seed, POOLS["homogeneous"])
        write_cell(archive, "mixed", "geo_mask", seed, POOLS["mixed"], scale=3.0)
        write_cell(archive, "homogeneous", "grpo", seed, POOLS["homogeneous"])
        write_cell(archive, "far", "grpo", seed, dict(POOLS["far"], finals=POOLS["homogeneous"]["finals"]),
                   scale=100.0)
    return write_sweep(root / "sweep.yaml", list(POOLS)), archive


def expected(pool: str, scale: float = 1.0) -> tuple[float, float]:
    """Independently: the worst training group's mean probe KL over seeds, and the largest mean
    share over that of the group with the lowest mean probe KL (the evaluation group never counts)."""
    groups = POOLS[pool]["groups"]
    kl = {g: sum(v) / len(v) * scale for g, (v, _) in groups.items()}
    oor = {g: sum(v) / len(v) * scale for g, (_, v) in groups.items()}
    ref = min(kl, key=kl.get)
    return max(kl.values()), max(max(0.0, o - oor[ref]) for o in oor.values())


def test_the_synthetic_verdicts_follow_the_rule():
    """The pools' verdicts by intervals.py's rule, recomputed from the numbers written (the archive's
    reading is not involved): what the limits test below relies on."""
    def outcome(pool):
        spec = POOLS[pool]
        collapsed = [i in spec["reward_collapse"] or f < 0.15 for i, f in enumerate(spec["finals"])]
        return cell_outcome(pool, "sc_mis", spec["finals"], collapsed)

    control = outcome("homogeneous")
    for pool, within in (("mixed", True), ("wild", True), ("crash", False), ("far", False)):
        o = outcome(pool)
        same = overlap(o.pass_interval, control.pass_interval) and overlap(o.collapse_interval,
                                                                             control.collapse_interval)
        assert same == within, pool
    assert outcome("crash").collapses == 4 and overlap(outcome("crash").pass_interval, control.pass_interval)
    assert outcome("wild").collapses == 1


def test_limits_from_the_pools_that_stayed_within(grid):
    sweep, archive = grid
    doc = limits_document(str(sweep), str(archive), "2026-12-07")
    kl_mixed, oor_mixed = expected("mixed")
    kl_wild, oor_wild = expected("wild")
    assert (kl_mixed, oor_mixed) == pytest.approx((0.03, 0.013))  # the test's own arithmetic
    assert doc["max_probe_kl"] == pytest.approx(max(kl_mixed, kl_wild, expected("homogeneous")[0]), rel=1e-3)
    assert doc["max_out_of_range_added"] == pytest.approx(max(oor_mixed, oor_wild), rel=1e-3)
    assert doc["max_probe_kl"] == pytest.approx(0.07, rel=1e-3)  # wild's x: (0.04 x 3 + 0.16) / 4
    runs = doc["runs"]["sc_mis (SC + MIS), the limits follow it"]
    assert runs["control"].startswith("homogeneous (n = 4)")
    assert [r.split(" ")[0] for r in runs["within"]] == ["mixed", "wild"]
    assert [r.split(" ")[0] for r in runs["not_within"]] == ["crash", "far"]
    assert [r.split(" ")[0] for r in runs["not_assessable"]] == ["few"]
    assert "collapse rate: homogeneous/sc_mis" not in runs["not_within"][0]  # crash is the higher one
    assert "collapse rate: crash/sc_mis higher than homogeneous/sc_mis" in runs["not_within"][0]
    assert "final pass@1: homogeneous/sc_mis higher than far/sc_mis" in runs["not_within"][1]
    mixed = runs["within"][0]
    assert "probe KL 0.03 (m-nvfp4)" in mixed and "out-of-range added 0.0130 (q-int4 over z-bf16)" in mixed
    assert f"left out as evaluation-only: {EVAL}" in mixed and f"({EVAL})" not in " ".join(runs["within"])
    assert "max_probe_kl from wild/x; max_out_of_range_added from mixed/q-int4" in doc["source"]
    assert "n per SC + MIS cell: homogeneous 4, mixed 4, wild 4, crash 4, far 4, few 2 of 6" in doc["source"]
    assert "tiny CPU model" in doc["warning"]
    # geo_mask is kept for comparison (its limits are mixed's, x3), never the default's figures.
    geo = doc["runs"]["geo_mask (geo_mask), for comparison only"]
    kl3, oor3 = expected("mixed", scale=3.0)
    assert f"max_probe_kl {kl3:.4g} (mixed/m-nvfp4)" in geo["limits"]
    assert f"max_out_of_range_added {oor3:.4g} (mixed/q-int4)" in geo["limits"]
    assert "far/grpo 4" in doc["runs"]["n per cell"] and "grpo (" not in " ".join(doc["runs"])


def test_no_pool_within_gives_the_controls_figures(tmp_path):
    archive = tmp_path / "archive"
    for pool in ("homogeneous", "far"):
        for seed in range(SEEDS):
            write_cell(archive, pool, "sc_mis", seed, POOLS[pool])
    doc = limits_document(str(write_sweep(tmp_path / "s.yaml", ["homogeneous", "far"])), str(archive), "d")
    kl, oor = expected("homogeneous")
    assert (doc["max_probe_kl"], doc["max_out_of_range_added"]) == pytest.approx((kl, oor), rel=1e-3)
    assert "no pool stayed indistinguishable from the control under SC + MIS" in doc["source"]
    assert "max_probe_kl from homogeneous/b" in doc["source"]


def test_the_written_file_is_what_the_planner_reads(grid, tmp_path, capsys):
    sweep, archive = grid
    out = tmp_path / "limits.yaml"
    assert main([str(sweep), str(archive), "--out", str(out), "--date", "2026-12-07"]) == 0
    text = out.read_text()
    assert f"python -m experiments.report.limits_grid {sweep} {archive} --out {out}\n" in text
    limits = load_limits(out)
    assert limits.values["max_probe_kl"] == pytest.approx(0.07, rel=1e-3)
    assert limits.source.startswith(f"issue 48's grid ({sweep}, archive {archive}, 2026-12-07)")
    bounded = {k for k, v in limits.values.items() if v is not None}
    assert bounded == {"max_probe_kl", "max_out_of_range_added"}
    assert main([str(sweep), str(archive), "--out", str(out), "--condition", "seq_mis"]) == 2
    assert "no finished cell of condition 'seq_mis'" in capsys.readouterr().err


def test_eval_only_groups_by_config_or_by_no_trained_sample(tmp_path):
    """The config's eval_only group and train.eval_group are left out even with trained tokens; without
    a config, a group that trained no sample is."""
    class M:  # the one field eval_only_groups reads of a GroupMeasure
        def __init__(self, tokens_per_sample):
            self.tokens_per_sample = tokens_per_sample

    measures = {"a": M(10.0), "b": M(10.0), EVAL: M(10.0), "idle": M(float("nan"))}
    run = RunResult("p", "c", 0, tmp_path, ok=True)
    assert eval_only_groups(run, measures) == {"idle"}
    command = ["mixrl-train", "--config", str(CONFIG), "--run-dir", str(tmp_path),
               _groups_override(["a", "b"])]
    (tmp_path / "cell.json").write_text(json.dumps({"ok": True, "command": command}))
    assert eval_only_groups(run, measures) == {EVAL, "idle"}
    override = _groups_override(["a", "b", EVAL]).replace(f"{{name: {EVAL}, recipe: bf16, capacity: 8, "
                                                          "device: cpu}, ", "")
    (tmp_path / "cell.json").write_text(json.dumps({"ok": True, "command": [
        *command[:4], override.replace("eval_only: true", "eval_only: false"), "train.eval_group=b"]}))
    assert eval_only_groups(run, measures) == {"b", "idle"}


def test_the_committed_default_is_what_the_command_writes(monkeypatch):
    """experiments/plan_limits.yaml cannot drift from the archive: regenerating it with its own
    generated_by (same date) gives the same bytes. After re-archiving the grid, rerun the command
    in the file's header."""
    monkeypatch.chdir(ROOT)
    committed = (ROOT / "experiments" / "plan_limits.yaml").read_text()
    argv = shlex.split(yaml.safe_load(committed)["generated_by"])
    assert argv[:3] == ["python", "-m", "experiments.report.limits_grid"]
    text, _ = render(parser().parse_args(argv[3:]))
    assert text == committed, ("docs/results_decide changed: rerun the command in the header of "
                               "experiments/plan_limits.yaml")
    assert load_limits().source.startswith("issue 48's grid (configs/ablation_decide.yaml")
