"""configs/local_agentic.yaml end to end on this CPU, as shipped (issue 34): a tiny random Qwen3
with a real BPE tokenizer and chat template (scripts/make_tiny_chat_model.py), warm-started on the
``repo`` environment's scripted demonstrations, then trained asynchronously with a spawned sampler
running the coding episodes in sandboxes.

The run must show what the config is for: at least 30 % of episodes make two or more well-formed
tool calls, at least one episode spans a weight reload (``episode/versions`` > 1: its tokens were
sampled by more than one version), episodes reach 1,000 tokens or more, whole episodes are
logged per step and ``mixrl-train plot`` draws episode length, turns, tool-call outcomes and
version lag. Slow (the warm start on ~2,000-token demonstrations dominates: minutes on 2 cores);
tests/test_shipped_configs.py starts the same config in a short form in the default run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

from envs.sandbox import sandbox_available

ROOT = Path(__file__).parent.parent


def _make_model(out: Path) -> Path:
    path = ROOT / "scripts/make_tiny_chat_model.py"
    spec = importlib.util.spec_from_file_location("make_tiny_chat_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make(out)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.skipif(not sandbox_available(), reason="needs root + unshare (the repo task's sandbox)")
def test_local_agentic_runs_long_multi_turn_episodes_across_reloads(tmp_path):
    model = _make_model(tmp_path / "model")
    run = tmp_path / "run"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "2"}
    cmd = [str(ROOT / ".venv/bin/mixrl-train"), "--config", str(ROOT / "configs/local_agentic.yaml"),
           "--run-dir", str(run), f"model.hf_dir={model}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=3300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("step", 0) > 0 and "loss" in r]
    assert len(steps) == 12, [r.get("step") for r in records]
    # Every step has 8 episodes (2 prompts x 4): the mean of the per-step shares is the run's.
    two_plus = sum(r["tool/episodes_2plus_calls"] for r in steps) / len(steps)
    assert two_plus >= 0.3, [r["tool/episodes_2plus_calls"] for r in steps]
    assert max(r["episode/versions_max"] for r in steps) > 1, [r["episode/versions_max"] for r in steps]
    assert max(r["episode/tokens_max"] for r in steps) >= 1000
    assert all(0 <= r["tool/call_rate"] <= 1 for r in steps)

    episodes = [json.loads(line) for line in (run / "episodes" / "step_1.jsonl").read_text().splitlines()]
    assert len(episodes) == 4
    assert all(e["env"] == "repo" and e["turns"][0]["role"] == "prompt"
               and e["tokens"] > e["turns"][0]["tokens"] and e["turns"][1]["role"] == "policy"
               for e in episodes)
    spanned = [e for p in sorted((run / "episodes").glob("step_*.jsonl"))
               for e in map(json.loads, p.read_text().splitlines()) if len(e["versions"]) > 1]
    assert spanned and all(len({v for t in e["turns"] if t["role"] == "policy" for v in t["versions"]}) > 1
                           for e in spanned)

    plot = subprocess.run([str(ROOT / ".venv/bin/mixrl-train"), "plot", str(run)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert plot.returncode == 0, plot.stderr
    for name in ("episode_length", "episode_turns", "tool_outcomes", "version_lag"):
        assert (run / "plots" / f"{name}.png").is_file(), name
