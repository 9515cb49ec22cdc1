"""benchmarks/bench_weight_sync.py runs end to end on a tiny shape and reports every format."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~20 s alone, minutes on a loaded machine (JAX start, 15 tiny publishes)
def test_bench_weight_sync_smoke(tmp_path):
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "benchmarks/bench_weight_sync.py", "--vocab", "256",
                        "--hidden", "128", "--intermediate", "256", "--layers", "1", "--heads", "2",
                        "--kv-heads", "1", "--head-dim", "64", "--batch", "1", "--seq", "8",
                        "--dir", str(tmp_path), "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res["formats"]) == {"bf16", "fp8_block", "nvfp4", "mxfp4", "w8a8_int8"}
    for fmt, f in res["formats"].items():
        assert 0 < f["delta_bytes"] < f["full_bytes"], fmt  # one step at lr 1e-6 changes little
    assert res["miles_qwen3_30b_a3b_sync_s"] == {"rdma_h100": 2.16, "nccl_h100": 2.67}
    assert "--layers 1" in res["command"]
