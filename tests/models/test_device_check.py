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
    """The whole script's CPU form: every part's figures, the checked-kernel registry at the path
    given (as toy-shape entries, which never enable a kernel), a real two-step mixrl-train."""
    registry, out = tmp_path / "checked.json", tmp_path / "out"
    repo_registry = ROOT / "trainer_jax/kernels/checked.json"
    before = repo_registry.read_bytes()
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "JAX_PLATFORMS": "cpu"}
    env.pop("MIXRL_CHECKED_KERNELS", None)
    subprocess.run(["bash", str(ROOT / "scripts/device_check.sh"), "--tiny", "--registry", str(registry)],
                   check=True, env=env, cwd=ROOT, timeout=900, capture_output=True)
    report = json.loads((out / "device_check.json").read_text())
    kernels, step, fp8, train = (report[k] for k in ("kernels", "train_step", "fp8_linear", "mixrl_train"))
    assert not any("error" in part for part in (kernels, step, fp8, train)), report
    assert step["remat"] == "full" and step["tokens_per_s_median"] > 0
    assert math.isfinite(step["first_loss"])
    assert fp8["max_rel_err_vs_fp64"]["fp8"] < 0.1 and fp8["fp8_median_s"] > 0

    lse, attn = kernels["linear_logsumexp"], kernels["attention"]
    assert max(lse["max_rel_err_vs_reference"].values()) <= lse["tolerance"] == 2e-2  # bf16 inputs
    assert attn["pallas_gpu"]["pass"] and max(attn["pallas_gpu"]["max_rel_err"].values()) <= attn["tolerance"]
    entries = json.loads(registry.read_text())["entries"]
    assert json.loads((out / "checked.json").read_text())["entries"] == entries  # the copy in $OUT
    assert sorted(e["kernel"] for e in entries) == ["attention:pallas_gpu", "linear_logsumexp:pallas"]
    for e in entries:
        got = {k: e[k] for k in ("platform", "device_kind", "result", "tiny")}
        assert got == {"platform": "cpu", "device_kind": "cpu", "result": "pass", "tiny": True}
        assert e["jax_minor"] == ".".join(e["jax"].split(".")[:2]) and e["jaxlib"] and e["torch"]
        assert e["max_err"] <= e["tolerance"] and e["date"].startswith("20")
    assert repo_registry.read_bytes() == before  # --tiny never writes the package's file
    assert kernels["auto"][0].startswith("attention: blocked (auto: ")  # the CPU keeps its choice

    assert train["returncode"] == 0, train.get("output_tail")
    assert [s["step"] for s in train["steps"]] == [1, 2] and all(s["learner_s"] > 0 for s in train["steps"])
    lines = "\n".join(train["trainer_lines"])
    assert "attention: blocked (auto:" in lines and "loss kernel: xla (auto:" in lines
    assert any("computing on cpu" in line for line in train["sampler_lines"]), train["sampler_lines"]
    assert (out / "device_check_run" / "metrics.jsonl").exists()


def test_tiny_runs_write_the_package_registry_only_when_told(monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    from device_check import registry_path

    from trainer_jax.kernels.checked import ENV, REGISTRY

    monkeypatch.delenv(ENV, raising=False)
    assert registry_path(None, tiny=True) is None
    assert registry_path(None, tiny=False) == str(REGISTRY)
    assert registry_path("/x/reg.json", tiny=True) == "/x/reg.json"
    monkeypatch.setenv(ENV, "/y/reg.json")
    assert registry_path(None, tiny=True) == "/y/reg.json"


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
