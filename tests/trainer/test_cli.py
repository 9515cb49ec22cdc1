"""The console scripts exist, `--help` works, and the main job runs end to end on a tiny config."""

import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


@pytest.mark.parametrize("script", ["mixrl-train", "mixrl-sample", "mixrl-convert"])
def test_help(script):
    out = subprocess.run([BIN / script, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage" in out.stdout.lower()


def test_sweep_missing_file_is_a_clear_error():
    # `sweep` was the last planned subcommand; it now exists (tests/trainer/test_sweep.py).
    out = subprocess.run([BIN / "mixrl-train", "sweep", "configs/x.yaml"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "does not exist" in out.stderr


def test_bad_config_is_a_clear_error(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("modle: {}\n")
    out = subprocess.run([BIN / "mixrl-train", "--config", cfg], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "modle" in out.stdout
