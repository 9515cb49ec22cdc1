"""``env: verifiers`` end to end: the verifiers run of docs/environments.md, as written.
``mixrl-train`` with two sampler groups (bf16, int8) on a tiny random Qwen3 with a chat template
(``scripts/make_tiny_chat_model.py``), a task mix of the single-turn ``vf_echo`` taskset and the
multi-turn ``vf_guess`` environment beside this file, both through the real ``verifiers`` 0.4
package. Their episodes run in the samplers' env workers: verifiers renders each turn and calls the
workers' ``/inference/v1/generate``; the sampler's engine generates it. The block's config is
checked on every run; the commands run under the slow marker (every sampler worker and the
trainer's prompt workers import ``verifiers`` and load the renderer: minutes on a loaded 2-core
machine), from a directory that links the repository's scripts/ and tests/ so the relative paths
resolve and runs/ lands there. The block's ``pip install`` line is not run (the test needs the
extra installed and skips without it).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer_jax.config import load_config

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _doc_block() -> tuple[str, list[str]]:
    """The ``# vf_run.yaml`` block of docs/environments.md's verifiers section and the bash block
    after it (comments dropped)."""
    section = (ROOT / "docs" / "environments.md").read_text().split("### `verifiers` environments", 1)[1]
    rest = section[section.index("```yaml\n# vf_run.yaml"):]
    yaml = re.search(r"```yaml\n(# vf_run\.yaml\n.*?)```", rest, re.S).group(1)
    bash = re.search(r"```bash\n(.*?)```", rest, re.S).group(1)
    return yaml, [line.split("  #")[0].strip() for line in bash.splitlines() if line.strip()]


def test_the_documented_block_loads(tmp_path):
    yaml, commands = _doc_block()
    assert commands == ["pip install -e '.[verifiers]'",
                        "python scripts/make_tiny_chat_model.py runs/tiny-chat-model",
                        "PYTHONPATH=tests/envs mixrl-train --config vf_run.yaml"]
    (tmp_path / "vf_run.yaml").write_text(yaml)
    cfg = load_config(str(tmp_path / "vf_run.yaml"), [])
    assert [(m.name, m.env) for m in cfg.tasks.mix_entries()] == [("echo", "verifiers"),
                                                                 ("guess", "verifiers")]
    assert [g.name for g in cfg.groups] == ["bf16", "int8"]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_documented_commands_train_verifiers_environments_on_two_sampler_groups(tmp_path):
    pytest.importorskip("verifiers.v1", reason="the verifiers extra is not installed")
    yaml, (_install, make_model, train) = _doc_block()
    for name in ("scripts", "tests"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / "vf_run.yaml").write_text(yaml)
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "JAX_PLATFORMS": "cpu"}
    env.pop("PYTHONPATH", None)
    for command in (make_model, train):
        t0 = time.monotonic()
        out = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=1300)
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
        print(f"{command}: {time.monotonic() - t0:.0f} s")
    run = tmp_path / "runs" / "vf"

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("step", 0) > 0 and "loss" in r]
    assert len(steps) == 2
    errors = {k: v for r in steps for k, v in r.items() if "/errors/" in k and v}
    assert not errors, errors
    # Each rubric reward function's value, per step (Trajectory.reward_parts): the echo taskset's two.
    parts = {k for r in steps for k in r if k.startswith("env/echo/reward/")}
    assert parts == {"env/echo/reward/says_word", "env/echo/reward/short"}, parts
    episodes = [json.loads(line) for f in sorted((run / "episodes").glob("step_*.jsonl"))
                for line in f.read_text().splitlines()]
    kinds = {"echo" if "Say the word" in e["turns"][0]["text"] else "guess" for e in episodes}
    assert kinds == {"echo", "guess"}, [e["turns"][0]["text"] for e in episodes]
    for e in episodes:
        assert e["turns"][0]["role"] == "prompt" and "<|im_start|>assistant" in e["turns"][0]["text"]
        assert e["termination"] in ("answered", "length"), e["termination"]
    # The multi-turn environment played the user: its hints are observations between turns.
    hints = [t["text"] for e in episodes if "Guess my number" in e["turns"][0]["text"]
             for t in e["turns"] if t["role"] == "observation"]
    assert hints and all(("higher" in h or "lower" in h) for h in hints), hints[:4]
    groups = {k.split("/")[1] for r in steps for k in r
              if k.startswith("group/") and k.endswith("sample_share") and r[k] > 0}
    assert groups == {"bf16", "int8"}, groups


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_trainer_draws_verifiers_tasks_without_importing_torch(tmp_path):
    """The trainer process draws tasks from the taskset itself but hands ``start`` (rendering
    loads ``transformers``, which imports torch) to an env worker: drawing stays torch-free."""
    pytest.importorskip("verifiers.v1", reason="the verifiers extra is not installed")
    code = f"""
import sys
sys.path[:0] = [{str(Path(__file__).parent)!r}]
import numpy as np
from chat_dir import make_model_dir
from convert.tokenizer import load_tokenizer
from envs.loading import make_env
tok = load_tokenizer(make_model_dir(__import__("pathlib").Path({str(tmp_path / "m")!r})))
env = make_env("verifiers", tok, id="vf_guess")
tasks = [env.sample_task_at(np.random.default_rng(0), f"t{{k}}", k) for k in range(3)]
assert [t.payload["data"]["secret"] for t in tasks] == [4, 3, 2], tasks
assert "torch" not in sys.modules
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=500,
                         env={**os.environ, "MIXRL_ENV_WORKER": ""})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
