"""The real loop: rollout service + two sampler processes with different recipes, a few steps,
published versions, then a resumed run that continues where the first stopped."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
CONFIG = """
run: {name: it, seed: 0, steps: 3}
model: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 2,
        num_key_value_heads: 1, head_dim: 16}
sft: {steps: 3, sequences_per_step: 8, rows: 4, row_len: 64, max_tokens: 128}
tasks:
  env: mix
  group_size: 2
  sampling: {temperature: 1.0, head_k: 4, max_new_tokens: 6}
  mix: [{env: arithmetic, difficulty: 1}]
# A buffer of two groups split evenly: the faster bf16 sampler cannot run ahead with a second
# group, so every step trains on one group of each recipe (on a loaded machine bf16 otherwise
# filled every batch before the fp8 sampler, whose first round also compiles, finished a group).
service: {listen: "127.0.0.1:0", buffer: {max_trajectories: 4}, router: {policy: uniform}}
groups:
  - {name: bf16, recipe: bf16, capacity: 1}
  - {name: fp8, recipe: fp8, kv_cache_dtype: fp8_e4m3, capacity: 4}
train: {prompts_per_step: 2, publish_every: 1, checkpoint_every: 2, eval_every: 0, eval_tasks: 2,
        eval_k: 2, rows: 4, row_len: 32, max_tokens: 64, support_k: 4, episode_tokens: 32,
        take_timeout_s: 240}
"""


def _train(cfg: Path, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([BIN / "mixrl-train", "--config", cfg, "--run-dir", run_dir, *extra],
                          capture_output=True, text=True, timeout=600)


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(1200)
def test_train_publish_and_resume(tmp_path):
    cfg = tmp_path / "it.yaml"
    cfg.write_text(CONFIG)
    run_dir = tmp_path / "run"
    out = _train(cfg, run_dir)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    steps = [r for r in _records(run_dir) if r["step"] > 0 and "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        # Both recipes' samplers fed the learner; the fp8 group is measurably off-policy.
        assert r["samples_trained"] > 0 and r["tokens"] > 0
        assert 0.0 <= r["out_of_range"] <= 1.0 and r["k3"] >= 0.0
    assert {"group/bf16/sample_share", "group/fp8/sample_share", "group/fp8/k3"} <= set(steps[0])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and not summary["publish_errors"]
    # One device is the degenerate mesh of the one learner.
    assert summary["mesh"] == {"data": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}
    assert (summary["devices"], summary["processes"]) == (1, 1)
    assert set(summary["formats"]) == {"bf16", "fp8_block"}
    latest = (run_dir / "weights" / "LATEST").read_text().strip()
    assert latest == "v00000003"
    # v1.. are deltas against the version before (train.weights.delta) and materialize whole
    assert (run_dir / "weights" / latest / "fp8_block" / "delta.json").exists()
    from convert.delta import materialize
    from convert.store import open_store
    materialize(open_store(run_dir / "weights"), 3, "fp8_block", tmp_path / "v3")
    # The fp8 group runs an fp8_e4m3 KV cache: every version's fp8_block export carries K/V scales
    # calibrated on the trajectories trained before it, and says so (train.weights.calibrate).
    from convert.hf_checkpoint import HFCheckpoint
    from convert.manifest import read_manifest
    calibration = read_manifest(tmp_path / "v3")["calibration"]
    assert calibration["data"] == "trajectories" and calibration["source_version"] == 3
    assert "model.layers.0.self_attn.k_scale" in HFCheckpoint(tmp_path / "v3").names()
    assert "weights: 4 versions" in out.stdout
    # The version probe (docs/wire.md): every version carries probe.json in its manifest, both
    # samplers scored it after each load; bf16 serves closer to the trainer than fp8 + fp8 KV.
    assert "probe.json" in read_manifest(tmp_path / "v3")["files"]
    assert {"group/bf16/probe_kl", "group/fp8/probe_kl", "group/fp8/verified_lag"} <= set(steps[-1])
    probe = summary["probe"]
    assert set(probe["groups"]) == {"bf16", "fp8"} and not probe["alarms"]
    worst = {g: max(v["kl"] for v in probe["groups"][g].values()) for g in ("bf16", "fp8")}
    assert 0 < worst["bf16"] < worst["fp8"], worst
    for s in probe["samplers"]:  # every sampler verified the last version it loaded
        assert s["verified_version"] == s["last_version"] >= 1 and not s["revoked"], s
    assert (run_dir / "plots" / "probe_kl.png").exists()
    assert (run_dir / "plots" / "reward.png").exists()
    assert any((run_dir / "tensorboard").iterdir())
    for group in ("bf16", "fp8"):  # both samplers ran to the end of the run
        log = (run_dir / "logs" / f"{group}-0.log").read_text()
        assert re.search(r"done: \d+ rounds, \d+ accepted", log), log[-2000:]
        assert " 0 weight failures" in log, log[-2000:]  # every delta version applied and verified

    # Resume: continue to step 6 from the checkpoint; no step trained twice, fresh tasks.
    out = _train(cfg, run_dir, "--resume", "--steps", "6")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "resumed from step 3" in out.stdout
    records = [r for r in _records(run_dir) if r["step"] > 0 and "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    # Over the run both recipes' samples were trained on.
    shares = {g: sum(r[f"group/{g}/sample_share"] for r in records) for g in ("bf16", "fp8")}
    assert all(v > 0 for v in shares.values()), shares
    # ... and each sampler had trajectories accepted, in the first run or the resumed one (logs
    # are appended across runs): on a loaded machine the fp8 sampler, slower to start, finished no
    # round before bf16's groups had fed all three first steps (CI, 2026-12-07).
    for group in ("bf16", "fp8"):
        log = (run_dir / "logs" / f"{group}-0.log").read_text()
        assert re.search(r"done: \d+ rounds, [1-9]\d* accepted", log), log[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6
    assert int((run_dir / "weights" / "LATEST").read_text().strip()[1:]) > 3
