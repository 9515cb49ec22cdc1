"""The issue-20 report with two seeds per cell: which seed grew or collapsed is named, and the fold
over the run is the geometric seed mean (the fold of the mean slope), not the arithmetic one."""

from __future__ import annotations

import json
import math
from pathlib import Path

from experiments.report import collect
from experiments.report.grid import Grid
from experiments.report.seed_claims import growth_section, verdicts

N = 24


def _run(root: Path, pool: str, cond: str, seed: int, rate: float, eval_end: float = 0.8,
         eval_start: float = 0.8) -> None:
    """A finished run whose k3 changes by ``exp(rate)`` a step; held-out pass@1 from ``eval_start``
    to ``eval_end``."""
    run = root / pool / cond / f"seed{seed}"
    run.mkdir(parents=True)
    recs = [
        {"step": s, "loss": 0.1, "reward_mean": 0.04, "k3": 1e-3 * math.exp(rate * s)}
        for s in range(1, N + 1)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "summary.json").write_text(
        json.dumps({"eval_start": {"eval/pass@1": eval_start}, "eval_end": {"eval/pass@1": eval_end}})
    )
    (run / "cell.json").write_text(json.dumps({"ok": True, "wall_s": 30.0, "command": []}))


def test_two_seeds_are_named_and_folds_average_geometrically(tmp_path):
    # GRPO / mixed: seed 0's k3 falls 2.2x over the run, seed 1's rises 2.2x (and its held-out pass
    # falls); the seed mean slope is 0, so the fold over the run must read 1.00x (arithmetic: 1.33x).
    r = math.log(2.2) / (N - 1)
    _run(tmp_path, "mixed", "grpo", 0, -r)
    _run(tmp_path, "mixed", "grpo", 1, r, eval_end=0.2)
    _run(tmp_path, "homogeneous", "grpo", 0, 0.0)
    _run(tmp_path, "homogeneous", "grpo", 1, 0.0)
    grid = Grid.of(collect(tmp_path), {"grpo": "GRPO"}, {})
    row = next(line for line in growth_section(grid) if line.startswith("| GRPO | mixed |"))
    cols = [c.strip() for c in row.strip("|").split("|")]
    assert cols[3] == "2/2" and cols[6] == "1.00x", row
    assert cols[7] == "seed0: shrinking, seed1: growth", row
    assert cols[8] == "seed1: held-out pass@1 0.800 → 0.200", row
    homog = next(line for line in growth_section(grid) if line.startswith("| GRPO | homogeneous |"))
    assert "seed0: bounded, seed1: bounded" in homog and "| none |" in homog
    c1 = verdicts(grid)[0]
    # Claim 1 gives each cell's rate with its Wilson interval and the final pass@1's mean with its
    # bootstrap interval (0.8 and 0.2: their mean, and the pair's span).
    assert ("GRPO / mixed: collapsed 1 / 2 = 0.50 [0.09, 0.91], "
            "final held-out pass@1 0.500 [0.200, 0.800]") in c1.text
    assert ("GRPO / homogeneous: collapsed 0 / 2 = 0.00 [0.00, 0.66], "
            "final held-out pass@1 0.800 [0.800, 0.800]") in c1.text
    # One of two seeds collapsing decides nothing (issue 48's rule), where issue 20's report said
    # "reproduced (weak evidence)".
    assert c1.verdict == "not assessable at n = 2 / 2 (a verdict needs 3 runs a side)", c1.verdict
    # Nor does the same half-and-none split over 6 seeds: 3 / 6 [0.19, 0.81] overlaps 0 / 6 [0, 0.39].
    for seed in range(2, 6):
        _run(tmp_path, "mixed", "grpo", seed, r if seed % 2 else -r, eval_end=0.2 if seed % 2 else 0.8)
        _run(tmp_path, "homogeneous", "grpo", seed, 0.0)
    c1 = verdicts(Grid.of(collect(tmp_path), {"grpo": "GRPO"}, {}))[0]
    assert c1.verdict == "not distinguishable at n = 6 / 6", c1.verdict
    assert "GRPO / mixed: collapsed 3 / 6 = 0.50 [0.19, 0.81]" in c1.text


def test_reward_alarm_needs_a_reward_off_zero():
    # Seed 1 of issue 20's sweeps: a warm start that left rewards at a few thousandths, whose
    # half-of-best alarm fired on noise (0.002 vs best 0.005); the same shape 10x higher collapses.
    from experiments.report.runs import collapse_step

    shape = [3, 4, 5, 5, 5, 4, 5, 5, 4, 5, 4, 5, 3, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1]
    tiny = [{"step": s, "reward_mean": 1e-3 * x} for s, x in enumerate(shape, 1)]
    real = [{"step": s, "reward_mean": 1e-2 * x} for s, x in enumerate(shape, 1)]
    assert collapse_step(tiny)[0] is None
    step, why, _ = collapse_step(real)
    assert step is not None and why.startswith("reward collapsing")


def test_two_seeds_note_where_each_started(tmp_path):
    from experiments.report.summary import reading_notes

    _run(tmp_path, "mixed", "grpo", 0, 0.0)
    _run(tmp_path, "mixed", "grpo", 1, 0.0, eval_start=0.6)
    grid = Grid.of(collect(tmp_path), {"grpo": "GRPO"}, {})
    note = next(n for n in reading_notes(grid) if n.startswith("Each seed starts RL"))
    assert "seed 0: held-out pass@1 at the start of RL 0.800" in note
    assert "seed 1: held-out pass@1 at the start of RL 0.600" in note
    assert not any(n.startswith("Every seed starts RL from one shared") for n in reading_notes(grid))
    one = Grid.of([r for r in collect(tmp_path) if r.seed == 0], {"grpo": "GRPO"}, {})
    assert not any(n.startswith(("Each seed", "Every seed")) for n in reading_notes(one))


def test_seeds_from_one_shared_warm_start_are_said_to_vary_rl_only(tmp_path):
    # Issue 48's grid: every seed's RL starts from the same warm start (the same held-out pass@1).
    from experiments.report.summary import reading_notes

    for seed in (0, 1, 2):
        _run(tmp_path, "mixed", "grpo", seed, 0.0)
    notes = reading_notes(Grid.of(collect(tmp_path), {"grpo": "GRPO"}, {}))
    [note] = [n for n in notes if n.startswith(("Each seed", "Every seed"))]
    assert note.startswith("Every seed starts RL from one shared warm start (held-out pass@1 0.800 before")
    assert "seed 0 0.040; seed 1 0.040; seed 2 0.040" in note, note
    # Rewards of a few hundredths: the chain task's note (issue 48's grid, ~0.4, has none).
    assert any("`chain` task" in n for n in notes)


def test_a_held_out_collapse_is_more_than_sampling_noise():
    """Halving a small pass rate over few samples is noise; over many, or from a high start, not."""
    from experiments.report.runs import RunResult

    def run(start: float, end: float, samples: int) -> RunResult:
        r = RunResult("mixed", "grpo", 0, Path("."), ok=True, eval_samples=samples)
        r.eval_start, r.eval_final = start, end
        return r

    assert not run(15 / 128, 7 / 128, 128).eval_collapsed  # 1.8 standard errors
    assert run(15 / 128, 7 / 128, 1024).eval_collapsed  # the same rates over 8x the samples
    assert run(0.8, 0.2, 128).eval_collapsed
    assert not run(0.8, 0.5, 128).eval_collapsed  # a significant drop, but not to half
    assert run(15 / 128, 7 / 128, 0).eval_collapsed  # sample count unknown: the ratio decides
