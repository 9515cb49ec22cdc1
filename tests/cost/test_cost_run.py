"""A real short `mixrl-train` run (tests/loop_configs.py's TINY_LOOP, two spawned sampler groups)
under router policy cost with prices: it writes the cost metrics, the plot and summary.json's
"cost" section, and warns (never refuses) that samplers priced as H100 compute on the CPU; then
`mixrl-train plan` on that run writes a plan.yaml that merges into the run's config (price table
-> run -> plan -> config, end to end)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from loop_configs import TINY_LOOP

from experiments.cli import main as train_main
from trainer_jax.config import load_config
from trainer_jax.plan_file import plan_overrides

ROOT = Path(__file__).parent.parent.parent
CONFIG = (TINY_LOOP
          .replace('service: {listen: "127.0.0.1:0", ',
                   'service: {listen: "127.0.0.1:0", router: {policy: cost, max_share: 0.9}, ')
          .replace("{name: bf16, recipe: bf16, capacity: 2}",
                   "{name: bf16, recipe: bf16, capacity: 2, accelerator: H100}")
          .replace("{name: int8, recipe: int8, capacity: 2}",
                   "{name: int8, recipe: int8, capacity: 2, accelerator: cpu, price_per_hour: 1.5}"))


@pytest.mark.timeout(900)
def test_priced_run_writes_cost_metrics_and_summary(tmp_path):
    assert "policy: cost" in CONFIG and "price_per_hour: 1.5" in CONFIG and "accelerator: H100" in CONFIG
    cfg, prices, run_dir = tmp_path / "c.yaml", tmp_path / "prices.yaml", tmp_path / "run"
    cfg.write_text(CONFIG)
    prices.write_text("H100: 4.0\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-m", "trainer_jax.cli", "--config", str(cfg), "--run-dir",
                          str(run_dir), "--prices", str(prices)],
                         env=env, capture_output=True, text=True, timeout=840, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # bf16 is priced as an H100 but computes on this CPU: one warning per sampler, not a refusal
    # (a console line: trainer_jax.console_log prints log records with the run's other lines).
    console = out.stdout + out.stderr
    assert "warning: " in console and "priced as accelerator 'H100' but reports cpu" in console
    assert "priced as accelerator 'cpu'" not in console
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    usd = [r["cost/usd_total"] for r in steps]
    assert usd[0] > 0 and usd == sorted(usd)
    assert sum(r["cost/usd_per_step"] for r in steps) == pytest.approx(usd[-1])
    last = steps[-1]
    cost = json.loads((run_dir / "summary.json").read_text())["cost"]
    for g, price in (("bf16", 4.0), ("int8", 1.5)):
        hours = last[f"group/{g}/replica_hours"]
        assert 0 < hours < 1
        assert last[f"group/{g}/usd_total"] == pytest.approx(price * hours)
        # a step where the group had no samples trained has no useful share (4 samples a step)
        shares = [r[f"group/{g}/useful_share"] for r in steps if f"group/{g}/useful_share" in r]
        assert all(0 < u <= 1 for u in shares)
        if cost["groups"][g]["useful_samples"] > 0:
            assert last[f"group/{g}/usd_per_useful_sample"] > 0
            assert last[f"group/{g}/usd_per_useful_token"] < last[f"group/{g}/usd_per_useful_sample"]
    assert any(cost["groups"][g]["useful_samples"] > 0 for g in ("bf16", "int8"))
    assert sum(last[f"group/{g}/lease_share"] for g in ("bf16", "int8")) == pytest.approx(1.0)
    assert any(r.get(f"group/{g}/samples_per_busy_replica_s", 0) > 0 for r in steps for g in ("bf16", "int8"))
    assert cost["steps"] == 3 and cost["usd_total"] == pytest.approx(usd[-1])
    assert cost["groups"]["bf16"]["price_per_hour"] == 4.0 and cost["groups"]["bf16"]["accelerator"] == "H100"
    trained = sum(cost["groups"][g]["samples_trained"] for g in ("bf16", "int8"))
    assert trained == sum(r["samples_trained"] for r in steps)
    assert cost["usd_per_useful_sample"] == pytest.approx(cost["usd_total"] / cost["useful_samples"])
    assert (run_dir / "plots" / "cost.png").exists()

    # The planner on this run: prices and accelerators from the run's ledger, the dial limits.
    plan = tmp_path / "plan.yaml"
    code = train_main(["plan", str(run_dir), "--budget", "10", "--limits",
                       str(ROOT / "docs/results/limits_dial.yaml"), "--out", str(plan)])
    assert code in (0, 1)  # 1: no group could be planned (each excluded with its reason)
    doc = yaml.safe_load(plan.read_text())
    groups = {g["name"]: g for g in doc["groups"]}
    assert (groups["bf16"]["accelerator"], groups["bf16"]["price_per_hour"]) == ("H100", 4.0)
    assert (groups["int8"]["accelerator"], groups["int8"]["price_per_hour"]) == ("cpu", 1.5)
    spent = sum(g["processes"] * g["price_per_hour"] for g in groups.values())
    assert doc["cost_usd_per_hour"] == pytest.approx(spent) and spent <= 10
    for name, g in groups.items():
        if name in doc["excluded"]:  # an excluded group (with its reason) gets no replica
            assert g["processes"] == 0 and doc["excluded"][name], (name, doc)
        elif g["processes"] == 0 and g["price_per_hour"] <= 10:
            # eligible but left out: the optimum spent the budget better elsewhere, so forcing one
            # replica of it buys no more useful samples per hour (the solver is exact)
            forced = tmp_path / f"plan_min_{name}.yaml"
            assert train_main(["plan", str(run_dir), "--budget", "10", "--limits",
                               str(ROOT / "docs/results/limits_dial.yaml"), "--min", f"{name}=1",
                               "--out", str(forced)]) == 0
            forced_doc = yaml.safe_load(forced.read_text())
            assert forced_doc["useful_samples_per_hour"] <= doc["useful_samples_per_hour"] + 1e-6, (name, doc)
    planned = [n for n, g in groups.items() if g["processes"]]
    if planned:  # the budget is spent down to less than the cheapest planned group's price
        assert 10 - doc["cost_usd_per_hour"] < min(groups[n]["price_per_hour"] for n in planned)
        # (into the config without its max_share: a plan of one group cannot keep 0.9 of the
        # leases under it, which load_config refuses in one line)
        plain = tmp_path / "plain.yaml"
        plain.write_text(CONFIG.replace(", max_share: 0.9", ""))
        merged = load_config(plain, plan_overrides(plain, plan), prices=prices)
        assert [(g.name, g.processes) for g in merged.groups] == \
            [(n, groups[n]["processes"]) for n in planned]
