"""The optional Weights & Biases sink (``logging.wandb``), offline: files under the run directory."""

import importlib.util

import pytest

from trainer_jax.config import ConfigError, load_config
from trainer_jax.diagnostics import METRICS_FILE, MetricsSink


def test_logging_wandb_config_is_checked_at_load():
    if importlib.util.find_spec("wandb") is None:  # the extra is not installed: one line says so
        with pytest.raises(ConfigError, match=r"pip install 'mixrl\[wandb\]'"):
            load_config(None, ["logging.wandb={project: mixrl-test}"])
        return
    cfg = load_config(None, ["logging.wandb={project: mixrl-test}"])
    assert cfg.logging.wandb.mode == "offline" and load_config(None).logging.wandb is None
    with pytest.raises(ConfigError, match="logging.wandb.mode"):
        load_config(None, ["logging.wandb={project: p, mode: cloud}"])


def test_offline_wandb_run_beside_the_jsonl(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = MetricsSink(tmp_path, tensorboard=False, wandb={"project": "mixrl-test", "mode": "offline"})
    sink.write(-3, {"sft/loss": 2.0})  # warm-start steps stay out of W&B (its steps only grow)
    sink.write(1, {"loss": 0.5, "reward_mean": 0.25})
    sink.write(2, {"loss": 0.4, "reward_mean": 0.5})
    sink.close()
    assert len((tmp_path / METRICS_FILE).read_text().splitlines()) == 3
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(p.suffix == ".wandb" and p.stat().st_size > 0 for p in runs[0].iterdir())
