"""A fresh run never mixes with an earlier one in the same run directory."""

from __future__ import annotations

from trainer_jax.train import set_aside_previous_run


def test_an_earlier_run_is_set_aside_not_deleted(tmp_path):
    run = tmp_path / "local_mixed"
    (run / "weights" / "v00000300").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 300}\n')
    aside = set_aside_previous_run(run)
    assert aside is not None and not run.exists()
    assert aside.name.startswith("local_mixed.previous-")
    assert (aside / "weights" / "v00000300").is_dir() and (aside / "metrics.jsonl").read_text()
    # A second earlier run in the same second gets its own name.
    (run / "checkpoints").mkdir(parents=True)
    second = set_aside_previous_run(run)
    assert second is not None and second != aside and (second / "checkpoints").is_dir()


def test_a_directory_without_run_artifacts_is_left_alone(tmp_path):
    run = tmp_path / "cell"
    run.mkdir()
    (run / "train.log").write_text("the sweep writes this before the trainer starts\n")
    assert set_aside_previous_run(run) is None
    assert (run / "train.log").exists()
    assert set_aside_previous_run(tmp_path / "missing") is None
