"""``scripts/device_check.sh --tiny`` runs every part of the GPU check on this CPU and writes JSON."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_device_check_tiny_writes_every_part(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "JAX_PLATFORMS": "cpu"}
    subprocess.run(["bash", str(ROOT / "scripts/device_check.sh"), "--tiny"], check=True, env=env,
                   cwd=ROOT, timeout=900, capture_output=True)
    report = json.loads((tmp_path / "device_check.json").read_text())
    step, lse, fp8 = report["train_step"], report["linear_logsumexp"], report["fp8_linear"]
    assert "error" not in step and "error" not in lse and "error" not in fp8, report
    assert step["remat"] == "full" and step["tokens_per_s_median"] > 0
    assert math.isfinite(step["first_loss"])
    assert max(lse["max_rel_err_vs_reference"].values()) < 2e-2  # bf16 inputs
    assert fp8["max_rel_err_vs_fp64"]["fp8"] < 0.1 and fp8["fp8_median_s"] > 0


def test_mfu_arithmetic():
    sys.path.insert(0, str(ROOT / "scripts"))
    from device_check import QWEN3_06B, model_flops_per_token, peak_tflops

    from convert.qwen3_config import Qwen3Config

    cfg = Qwen3Config(**QWEN3_06B)
    # ~0.6 B matmul parameters at 6 FLOPs each per token, plus causal attention (~40 % more at 4,096).
    per_token = model_flops_per_token(cfg, 4096)
    assert 6 * 0.55e9 * 1.3 < per_token < 6 * 0.65e9 * 1.5
    # Two packed sequences of a third and two thirds: 5/9 of the one-sequence attention work.
    packed = model_flops_per_token(cfg, 4096, [1365, 2731])
    matmuls = model_flops_per_token(cfg, 4096, [0])  # no keys seen: the matmul parameters alone
    ratio = (packed - matmuls) / (per_token - matmuls)
    assert abs(ratio - (1365**2 + 2731**2) / 4096**2) < 1e-6
    assert peak_tflops("NVIDIA H200") == 989.0 and peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("some CPU") is None
