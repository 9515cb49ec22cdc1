"""`mixrl-train` on a device mesh, through the GPU launcher, with real sampler processes.

8 fake CPU devices: 3 steps on a (2 data x 2 fsdp x 2 tensor) mesh, then `--resume` onto
(4 fsdp x 2 tensor) to step 5 — the checkpoint restores onto another layout, metrics continue.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from loop_configs import TINY_LOOP

ROOT = Path(__file__).parent.parent.parent
CONFIG = TINY_LOOP


def _launch(cfg: Path, run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "PYTHON": sys.executable}
    return subprocess.run(
        [str(ROOT / "scripts/launch_gpu_host.sh"), str(cfg), "--run-dir", str(run_dir), *args],
        env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)


# Through the GPU launch script, as a user starts it (the two-process form of the loop is
# tests/parallel/test_multiprocess_training.py).
@pytest.mark.timeout(1200)
def test_train_on_a_mesh_then_resume_onto_another(tmp_path):
    cfg = tmp_path / "mesh.yaml"
    cfg.write_text(CONFIG)
    run_dir = tmp_path / "run"
    out = _launch(cfg, run_dir, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["mesh"] == {"data": 2, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}
    assert summary["devices"] == 8
    assert summary["steps"] == 3

    out = _launch(cfg, run_dir, "--resume", "--steps", "5", "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "resumed from step 3" in out.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["mesh"] == {"data": 1, "fsdp": 4, "expert": 1, "context": 1, "tensor": 2}
    assert summary["steps"] == 5
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 0 and "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert all(r["samples_trained"] > 0 for r in steps)
