"""Price table -> run -> plan -> plan.yaml -> run config, end to end on a real short `mixrl-train`
run (tests/loop_configs.py's TINY_LOOP: two spawned sampler groups on this CPU, priced as an H100
and an RTX PRO 6000). Marked slow: the run takes ~40 s on a quiet 2-core machine (97 s at load
10), over the planner's test budget; the fast tests (test_plan.py) cover the arithmetic."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from loop_configs import TINY_LOOP

from trainer_jax.config import load_config
from trainer_jax.plan import plan_overrides

ROOT = Path(__file__).parent.parent.parent
CONFIG = (TINY_LOOP
          .replace("{name: bf16, recipe: bf16, capacity: 2}",
                   "{name: bf16, recipe: bf16, capacity: 2, accelerator: H100}")
          .replace("{name: int8, recipe: int8, capacity: 2}",
                   "{name: int8, recipe: int8, capacity: 2, accelerator: RTXPRO6000}"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_plan_from_a_real_run(tmp_path):
    assert "accelerator: RTXPRO6000" in CONFIG and "accelerator: H100" in CONFIG
    cfg, prices = tmp_path / "c.yaml", tmp_path / "prices.yaml"
    run, plan = tmp_path / "run", tmp_path / "plan.yaml"
    cfg.write_text(CONFIG)
    prices.write_text("H100: 4.00\nRTXPRO6000: 1.80\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-m", "trainer_jax.cli", "--config", str(cfg), "--run-dir",
                          str(run), "--prices", str(prices)],
                         env=env, capture_output=True, text=True, timeout=840, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    out = subprocess.run([sys.executable, "-m", "trainer_jax.cli", "plan", str(run), "--budget", "10",
                          "--limits", "docs/results/limits_dial.yaml", "--out", str(plan)],
                         env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode in (0, 1), out.stderr  # 1: no group could be planned (said on stdout)
    assert "limits from docs/results/limits_dial.yaml: mixrl sweep report(s)" in out.stdout
    doc = yaml.safe_load(plan.read_text())
    groups = {g["name"]: g for g in doc["groups"]}
    # The accelerators and prices come from the run's summary.json (the cost ledger recorded them).
    assert groups["bf16"]["accelerator"] == "H100" and groups["bf16"]["price_per_hour"] == 4.0
    assert groups["int8"]["accelerator"] == "RTXPRO6000" and groups["int8"]["price_per_hour"] == 1.8
    assert doc["cost_usd_per_hour"] == pytest.approx(sum(g["processes"] * g["price_per_hour"]
                                                         for g in groups.values()))
    assert doc["cost_usd_per_hour"] <= 10
    for name, g in groups.items():  # each group planned, or excluded with its reason
        assert (g["processes"] > 0) != (name in doc["excluded"]), (name, doc)
    planned = [n for n, g in groups.items() if g["processes"]]
    if planned:  # a 10 USD budget is spent down to less than the cheapest planned group's price
        assert 10 - doc["cost_usd_per_hour"] < min(groups[n]["price_per_hour"] for n in planned)
        merged = load_config(cfg, plan_overrides(cfg, plan), prices=prices)
        assert [(g.name, g.processes) for g in merged.groups] == \
            [(n, groups[n]["processes"]) for n in planned]
