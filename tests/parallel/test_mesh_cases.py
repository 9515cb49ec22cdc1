"""Each module in ``cases/`` in its own process with 8 fake CPU devices.

XLA fixes the device count when JAX starts, and this process's JAX has one device (the rest of the
suite must not be slowed or changed by eight), so every case module runs as
``python -m pytest cases/<module>`` with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``.
On failure the inner pytest report is the assertion message.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
CASES = sorted(p.name for p in (HERE / "cases").glob("case_*.py"))


@pytest.mark.parametrize("case", CASES)
def test_mesh_case(case: str) -> None:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0",
           # The partitioner's performance notes ("involuntary full rematerialization") are noise here.
           "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(HERE / "cases" / case)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{case} failed:\n{proc.stdout[-12000:]}\n{proc.stderr[-4000:]}"
