"""The cost ledger across `mixrl-train --resume`: a real priced run frozen and killed after a
checkpoint, resumed at a new price, continues the checkpointed totals (the killed run's step past
the checkpoint is trained and charged again). Below it, the ledger's state round trip and the
checkpoints it cannot continue (none saved, unreadable): a warning line and totals from 0."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import proc_state

from trainer_jax.cost import CostLedger, LedgerStateError, StepCounts, ledger_from_checkpoint

BIN = Path(sys.executable).parent
CONFIG = """
run: {name: cost-resume, seed: 0, steps: 4}
model: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 2,
        num_key_value_heads: 1, head_dim: 16}
sft: {steps: 0}
tasks:
  env: arithmetic
  group_size: 2
  sampling: {temperature: 1.0, head_k: 4, max_new_tokens: 6}
service: {listen: "127.0.0.1:0", buffer: {max_trajectories: 16}}  # 4 steps' worth (tests/loop_configs.py)
groups:
  - {name: bf16, recipe: bf16, capacity: 4, threads: 1, accelerator: cpu, price_per_hour: PRICE}
train: {prompts_per_step: 2, publish_every: 1, checkpoint_every: 2, eval_every: 0, eval_tasks: 0,
        rows: 4, row_len: 32, max_tokens: 64, support_k: 4, episode_tokens: 32, take_timeout_s: 240}
"""


def _records(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


@pytest.mark.timeout(600)
def test_resumed_run_continues_the_checkpointed_ledger(tmp_path):
    run_dir, marker = tmp_path / "run", tmp_path / "frozen"
    first_cfg, second_cfg = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first_cfg.write_text(CONFIG.replace("PRICE", "6.0"))
    second_cfg.write_text(CONFIG.replace("PRICE", "2.0"))  # repriced between the runs
    # Frozen before step 4's update: steps 1-3 are recorded, the last checkpoint is step 2's.
    env = {**os.environ, "MIXRL_FAULT_POINT": "learner_step:4", "MIXRL_FAULT_MARKER": str(marker)}
    first = subprocess.Popen([BIN / "mixrl-train", "--config", first_cfg, "--run-dir", run_dir], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not (marker.exists() and proc_state(first.pid) == "T"):
            assert first.poll() is None, f"the first run exited with {first.returncode}"
            assert time.monotonic() < deadline, "the first run never reached step 4"
            time.sleep(0.05)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(30)
    before = _records(run_dir / "metrics.jsonl")
    assert [r["step"] for r in before] == [1, 2, 3]

    out = subprocess.run([BIN / "mixrl-train", "--config", second_cfg, "--run-dir", run_dir, "--resume",
                          "--steps", "5"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "resumed from step 2" in out.stdout and "cost ledger" not in out.stdout + out.stderr
    steps = _records(run_dir / "metrics.jsonl")
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert steps[:2] == before[:2]  # the checkpointed steps' records, kept
    # The killed run's step 3 went aside with its charge; the resumed run charged it again.
    assert [r["step"] for r in _records(run_dir / "metrics.discarded.jsonl")] == [3]

    usd = [r["cost/usd_total"] for r in steps]
    hours = [r["group/bf16/replica_hours"] for r in steps]
    assert usd == sorted(usd) and usd[2] > usd[1] > 0, usd  # never falls back across the resume
    assert hours == sorted(hours) and hours[2] > hours[1] > 0, hours
    assert sum(r["cost/usd_per_step"] for r in steps) == pytest.approx(usd[-1])
    # Steps 1-2 kept the price they were charged at; steps 3-5 were charged at the new one.
    assert usd[1] == pytest.approx(6.0 * hours[1])
    assert usd[-1] == pytest.approx(usd[1] + 2.0 * (hours[-1] - hours[1]))
    assert steps[-1]["group/bf16/usd_total"] == pytest.approx(usd[-1])
    produced = [r["group/bf16/samples_produced_total"] for r in steps]
    assert produced == sorted(produced) and produced[2] > produced[1], produced  # the base carried

    cost = json.loads((run_dir / "summary.json").read_text())["cost"]
    assert (cost["steps"], cost["from_step"]) == (5, 0)
    assert cost["usd_total"] == pytest.approx(usd[-1])
    assert cost["replica_hours"] == pytest.approx(hours[-1])
    group = cost["groups"]["bf16"]
    assert group["price_per_hour"] == 2.0 and group["usd"] == pytest.approx(usd[-1])
    assert group["samples_trained"] == sum(r["samples_trained"] for r in steps)
    assert group["samples_trained"] == steps[-1]["group/bf16/samples_trained_total"]


# ------------------------------------------------------------------ the state, by hand


def _step(ledger: CostLedger, wall_s: float, replicas: int, produced: int, busy: float) -> dict:
    return ledger.step(wall_s, {"a": StepCounts(replicas=replicas, produced_total=produced,
                                                busy_replica_s_total=busy, samples_trained=4,
                                                tokens_trained=40, useful_share=0.5)})


def test_state_round_trip_continues_totals_and_keeps_old_prices():
    ledger = CostLedger({"a": 3.6}, {"a": "H100"})
    _step(ledger, 100.0, 2, produced=10, busy=50.0)   # 200 replica-s at $3.6/h = $0.2
    state = json.loads(json.dumps(ledger.state()))    # as the checkpoint's JSON meta holds it

    resumed, warning = ledger_from_checkpoint({"a": 7.2}, {"a": "H100"}, {"step": 1, "cost": state})
    assert warning is None
    # The new service counts from 0: its 4 produced / 10 busy s add to the restored 10 / 50.
    v = _step(resumed, 50.0, 1, produced=4, busy=10.0)  # 50 replica-s at $7.2/h = $0.1
    assert v["cost/usd_total"] == pytest.approx(0.3) and v["cost/usd_per_step"] == pytest.approx(0.1)
    assert v["group/a/usd_total"] == pytest.approx(0.3)
    assert v["group/a/replica_hours"] == pytest.approx(250 / 3600)
    assert v["group/a/samples_produced_total"] == 14 and v["group/a/samples_trained_total"] == 8
    assert v["group/a/busy_replica_hours"] == pytest.approx(60 / 3600)
    s = resumed.summary()
    assert (s["steps"], s["from_step"], s["useful_samples"]) == (2, 0, 4.0)
    assert s["usd_total"] == pytest.approx(0.3)
    assert s["usd_busy_total"] == pytest.approx(3.6 * 50 / 3600 + 7.2 * 10 / 3600)
    assert s["groups"]["a"]["price_per_hour"] == 7.2
    # A second resume keeps both prices' charges (the state saves USD, not only hours).
    again, _ = ledger_from_checkpoint({"a": 1.0}, {}, {"step": 2, "cost": resumed.state()})
    assert again.summary()["usd_total"] == pytest.approx(0.3)


def test_group_no_longer_configured_keeps_its_totals_and_a_newly_priced_one_starts_paying():
    ledger = CostLedger({"a": 3.6, "b": None})
    ledger.step(100.0, {"a": StepCounts(replicas=1), "b": StepCounts(replicas=1)})
    resumed, _ = ledger_from_checkpoint({"b": 36.0}, {}, {"step": 1, "cost": ledger.state()})
    v = resumed.step(100.0, {"b": StepCounts(replicas=1)})
    assert v["group/b/usd_total"] == pytest.approx(1.0)  # only the 100 s since it was priced
    assert v["cost/usd_total"] == pytest.approx(0.1 + 1.0)
    assert resumed.summary()["groups"]["a"]["usd"] == pytest.approx(0.1)


def test_checkpoint_without_a_ledger_starts_at_zero_with_one_warning():
    ledger, warning = ledger_from_checkpoint({"a": 1.0}, {}, {"step": 6, "version": 6})
    assert warning == ("checkpoint step 6 has no cost ledger (written before the ledger was "
                       "checkpointed): cost totals start at 0 from step 6 (summary.json's cost "
                       "covers the steps after it only)")
    assert ledger.steps == 0 and ledger.usd_total == 0 and ledger.summary()["from_step"] == 6
    # kept through the next checkpoint: a second resume still says where the totals begin
    again, warning = ledger_from_checkpoint({"a": 1.0}, {}, {"step": 8, "cost": ledger.state()})
    assert warning is None and again.from_step == 6
    fresh, warning = ledger_from_checkpoint({"a": 1.0}, {}, None)  # nothing restored: no warning
    assert warning is None and fresh.from_step == 0


def _good() -> dict:
    ledger = CostLedger({"a": 3.6})
    _step(ledger, 100.0, 2, produced=10, busy=50.0)
    return ledger.state()


@pytest.mark.parametrize("corrupt, problem", [
    (lambda s: [s], "not a mapping but list"),
    (lambda s: {**s, "version": 99}, "version 99, this trainer reads 1"),
    (lambda s: {**s, "usd_total": "0.2"}, "'usd_total' is '0.2', not a number >= 0"),
    (lambda s: {**s, "steps": 1.5}, "'steps' is 1.5, not a whole number >= 0"),
    (lambda s: {**s, "groups": None}, "'groups' is not a mapping"),
    (lambda s: {**s, "groups": {"a": {**s["groups"]["a"], "replica_s": -1.0}}},
     "group 'a': 'replica_s' is -1.0, not a number >= 0"),
    (lambda s: {**s, "groups": {"a": {**s["groups"]["a"], "usd": math.nan}}},
     "group 'a': 'usd' is nan, not a number >= 0"),
    (lambda s: {**s, "groups": {"z": {**s["groups"]["a"], "accelerator": 3}}},
     "group 'z': 'accelerator' is not a string"),
])
def test_unreadable_ledger_is_one_warning_line_and_totals_from_zero(corrupt, problem):
    state = corrupt(_good())
    with pytest.raises(LedgerStateError, match="^" + problem.replace("(", r"\(").replace("[", r"\[")):
        CostLedger({"a": 3.6}).restore(state)
    ledger, warning = ledger_from_checkpoint({"a": 3.6}, {}, {"step": 4, "cost": state})
    assert warning == (f"checkpoint step 4 has an unreadable cost ledger ({problem}): cost totals "
                       "start at 0 from step 4 (summary.json's cost covers the steps after it only)")
    assert "\n" not in warning
    # nothing half-restored: every total is 0 and steps on from there
    assert ledger.steps == 0 and ledger.usd_total == 0.0 and ledger.groups["a"].replica_s == 0.0
    assert set(ledger.groups) == {"a"}
    assert _step(ledger, 100.0, 2, produced=3, busy=1.0)["cost/usd_total"] == pytest.approx(0.2)
