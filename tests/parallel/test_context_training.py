"""`mixrl-train` with context parallelism (issue 33, item 4), with real sampler processes.

8 fake CPU devices: 3 steps with each row's sequence split over ``context`` 4 (x fsdp 2), then
``--resume`` onto (context 2 x data 2 x fsdp 2) to step 5: the checkpoint restores onto the
other layout and summary.json names every axis. Marked ``slow`` (two trainer runs with their
samplers: 126 s on the 2-core host, 455 s under load); ``tests/parallel/cases/case_context.py`` checks the
step itself against one device in the default run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cpu_jax import cpu_jax_env
from loop_configs import TINY_LOOP

ROOT = Path(__file__).parent.parent.parent


def _train(cfg: Path, run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(Path(sys.executable).parent / "mixrl-train"), "--config", str(cfg), "--run-dir", str(run_dir),
         *args],
        env=cpu_jax_env(8), capture_output=True, text=True, timeout=1200, cwd=ROOT)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_train_with_context_parallelism_then_resume_onto_another_split(tmp_path):
    cfg = tmp_path / "context.yaml"
    cfg.write_text(TINY_LOOP)  # rows of 32 (sft: 64) tokens: 8 zigzag chunks of 4 on context 4
    run_dir = tmp_path / "run"
    out = _train(cfg, run_dir, "mesh.data=1", "mesh.fsdp=2", "mesh.context=4")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["mesh"] == {"data": 1, "fsdp": 2, "expert": 1, "context": 4, "tensor": 1}
    assert summary["devices"] == 8 and summary["steps"] == 3

    out = _train(cfg, run_dir, "--resume", "--steps", "5", "mesh.data=2", "mesh.fsdp=2", "mesh.context=2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "resumed from step 3" in out.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["mesh"] == {"data": 2, "fsdp": 2, "expert": 1, "context": 2, "tensor": 1}
    assert summary["steps"] == 5
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 0 and "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert all(r["samples_trained"] > 0 and r["loss"] == r["loss"] for r in steps)
