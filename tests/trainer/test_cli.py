"""The console scripts exist, `--help` works, and the main job runs end to end on a tiny config."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
ROOT = Path(__file__).parent.parent.parent


@pytest.mark.parametrize("script", ["mixrl-train", "mixrl-sample", "mixrl-convert"])
def test_help(script):
    out = subprocess.run([BIN / script, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage" in out.stdout.lower()


def test_sweep_missing_file_is_a_clear_error():
    # `sweep` was the last planned subcommand; it now exists (tests/experiments/test_sweep.py).
    out = subprocess.run([BIN / "mixrl-train", "sweep", "configs/x.yaml"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "does not exist" in out.stderr


def test_bad_config_is_a_clear_error(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("modle: {}\n")
    out = subprocess.run([BIN / "mixrl-train", "--config", cfg], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "modle" in out.stderr  # errors go to stderr, one line


def test_build_policy_takes_special_token_ids_from_the_tokenizer():
    from trainer_jax.config import load_config
    from trainer_jax.policy import build_policy

    cfg = load_config(None, ["model.hidden_size=16", "model.intermediate_size=32",
                             "model.num_hidden_layers=1", "model.num_attention_heads=2",
                             "model.num_key_value_heads=1", "model.head_dim=8"])
    _, qcfg = build_policy(cfg, 40, {"pad": 3, "bos": 7, "eos": 9})
    hf = qcfg.to_hf_dict()
    assert (hf["pad_token_id"], hf["bos_token_id"], hf["eos_token_id"]) == (3, 7, 9)
    assert hf["vocab_size"] == 40


def _train_cli(tmp_path, *args, devices=1):
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return subprocess.run([BIN / "mixrl-train", "--config", "configs/local_mixed.yaml", *args],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


def test_a_config_the_machine_cannot_run_fails_before_the_run_dir_is_touched(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text("{}")  # an earlier run: must stay where it is
    # key=value overrides may come before the flags (the SLURM script puts its own first).
    out = _train_cli(tmp_path, "model.attention=splash", "--run-dir", str(run_dir))
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "model.attention" in out.stderr and "runs on tpu, not on cpu" in out.stderr
    out = _train_cli(tmp_path, "--run-dir", str(run_dir), "train.rows=16", "train.micro_rows=4",
                     devices=8)
    assert out.returncode == 2 and "train.micro_rows (4) must be a multiple of the mesh's batch " \
        "shards (data 8 x fsdp 1 x expert 1 = 8)" in out.stderr, out.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing set aside
    assert [p.name for p in run_dir.iterdir()] == ["summary.json"]


def test_sft_refuses_an_existing_out_dir_before_training(tmp_path):
    out = subprocess.run([BIN / "mixrl-train", "sft", "--config", "configs/local_mixed.yaml", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and "already exists" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
