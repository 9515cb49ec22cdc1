"""The device check's end-to-end part: a real ``mixrl-train`` of a few steps, the JAX trainer and
one spawned sampler group on the same device.

    python scripts/device_check.py train [--tiny] [--timeout S]

The config is ``configs/device_check.yaml`` (a tiny random Qwen3, the character tokenizer, one
``bf16`` group with ``device: cuda``). JAX gets ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.45`` of the GPU
and the sampler the rest. ``--tiny`` runs it on the CPU: the group on ``device: cpu``, one layer, a
small batch. Reports the run's exit status, each step's
wall time split into waiting for samples and the learner, the trainer's start-up lines (kernels,
samplers) and the sampler's log lines that name its device; with ``OUT`` set, the run's stdout,
metrics and logs are copied to ``$OUT/device_check_run``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "device_check.yaml"
MEM_FRACTION = "0.45"
# Start-up lines worth reporting: the kernels auto picked, the samplers and their devices.
_TRAINER_LINES = re.compile(r"attention:|loss kernel:|sampler|regist|device|cuda|learner on", re.I)
_SAMPLER_LINES = re.compile(r"device|regist|cuda|accelerator|native|emulate|error|Traceback", re.I)


def tiny_config(cfg: dict) -> dict:
    """The CPU form: the group on the CPU, two steps of a small batch, one layer (the first
    step's compile is most of a CPU run)."""
    cfg = json.loads(json.dumps(cfg))
    for g in cfg["groups"]:
        g.update(device="cpu", capacity=16)
    cfg["run"]["steps"] = 2
    cfg["model"]["num_hidden_layers"] = 1
    cfg["tasks"]["group_size"] = 2
    cfg["tasks"]["sampling"]["max_new_tokens"] = 6
    cfg["train"].update(prompts_per_step=4, rows=4, row_len=64, max_tokens=256, episode_tokens=32)
    return cfg


def step_figures(metrics: Path) -> list[dict]:
    """Per step: wall seconds (taking samples + the learner step), split by the trainer's idle
    share (the wait for samples); from the ``tokens`` and ``tokens_per_s`` the trainer records."""
    out = []
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        r = json.loads(line)
        if r.get("step", 0) > 0 and r.get("tokens_per_s"):
            wall = r["tokens"] / r["tokens_per_s"]
            idle = r.get("trainer_idle_share", 0.0)
            out.append({"step": r["step"], "wall_s": round(wall, 4), "wait_s": round(wall * idle, 4),
                        "learner_s": round(wall * (1 - idle), 4), "tokens": r["tokens"],
                        "samples_trained": r.get("samples_trained")})
    return out


def _text(x: bytes | str | None) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else x or ""


def run(tiny: bool, timeout_s: float) -> dict:
    """Run the config (``--tiny``: its CPU form) with a deadline; return the report."""
    cfg = yaml.safe_load(CONFIG.read_text())
    if tiny:
        cfg = tiny_config(cfg)
    work = Path(tempfile.mkdtemp(prefix="mixrl-device-check-"))
    config, run_dir = work / "config.yaml", work / "run"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = {**os.environ, "XLA_PYTHON_CLIENT_MEM_FRACTION": MEM_FRACTION,
           # a checkout need not be installed: the trainer and the samplers it spawns import from it
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)  # the trainer takes its share up front
    cmd = [sys.executable, "-m", "trainer_jax.cli", "--config", str(config), "--run-dir", str(run_dir)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        rc, stdout = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:  # its output so far is bytes, whatever text= said
        rc, stdout = "timeout", "".join(_text(x) for x in (e.stdout, e.stderr))
    wall = time.perf_counter() - t0
    sampler_lines = []
    for log in sorted((run_dir / "logs").glob("*.log")):
        sampler_lines += [f"{log.stem}: {ln}" for ln in log.read_text(errors="replace").splitlines()
                          if _SAMPLER_LINES.search(ln)][:10]
    steps = step_figures(run_dir / "metrics.jsonl")
    report = {"config": str(CONFIG.relative_to(ROOT)) + (" (--tiny form)" if tiny else ""),
              "groups": [{k: g.get(k) for k in ("name", "recipe", "device")} for g in cfg["groups"]],
              "xla_python_client_mem_fraction": MEM_FRACTION, "returncode": rc,
              "wall_s": round(wall, 2), "steps": steps,
              "trainer_lines": [ln.strip() for ln in stdout.splitlines() if _TRAINER_LINES.search(ln)][:20],
              "sampler_lines": sampler_lines}
    if rc != 0:
        report["output_tail"] = stdout[-3000:]
    if os.environ.get("OUT"):
        keep = Path(os.environ["OUT"]) / "device_check_run"
        keep.mkdir(parents=True, exist_ok=True)
        (keep / "stdout.txt").write_text(stdout)
        for name in ("metrics.jsonl", "summary.json", "logs"):
            src = run_dir / name
            if src.is_dir():
                shutil.copytree(src, keep / name, dirs_exist_ok=True)
            elif src.exists():
                shutil.copy2(src, keep / name)
    shutil.rmtree(work, ignore_errors=True)
    return report
