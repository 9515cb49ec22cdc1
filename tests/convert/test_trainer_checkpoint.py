"""Exporting the params of a trainer training checkpoint (trainer_jax.checkpoint), through the
reader trainer_jax.checkpoint_export registers with convert.plugins."""

import json

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("flax")
optax = pytest.importorskip("optax")

from flax import nnx  # noqa: E402

from convert.formats.numerics import to_bf16  # noqa: E402
from convert.hf_checkpoint import HFCheckpoint  # noqa: E402
from convert.publish import publish  # noqa: E402
from convert.qwen3_config import Qwen3Config  # noqa: E402
from convert.sources import SourceError  # noqa: E402
from trainer_jax.checkpoint import Checkpointer  # noqa: E402
from trainer_jax.checkpoint_export import (  # noqa: E402
    TrainerCheckpointError,
    trainer_checkpoint_tensors,
)
from trainer_jax.models import init_model, iter_hf_tensors  # noqa: E402

CFG = Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=16)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("train") / "ckpt"
    ckpt = Checkpointer(root)
    models = {}
    for step, seed in ((3, 0), (8, 1)):
        model = init_model(CFG, seed=seed)
        ckpt.save(step, model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param),
                  {"step": step})
        models[step] = dict(iter_hf_tensors(model))
    ckpt.close()
    return root, models


def test_params_of_latest_and_chosen_step(trained):
    root, models = trained
    for step in (None, 3):
        got = dict(trainer_checkpoint_tensors(root, CFG, step))
        want = models[step or 8]
        assert set(got) == set(want)
        assert all(np.array_equal(got[n], want[n]) for n in want)
    with pytest.raises(TrainerCheckpointError, match="no step 5"):
        list(trainer_checkpoint_tensors(root, CFG, 5))


def test_publish_from_a_training_checkpoint(trained, tmp_path):
    root, models = trained
    with pytest.raises(SourceError, match="stores no model config"):
        publish(root, None, tmp_path / "pub", 0, ["bf16"])
    paths = publish(root, CFG, tmp_path / "pub", 8, ["bf16", "nvfp4"])
    bf16 = HFCheckpoint(paths["bf16"])
    for name, arr in models[8].items():
        got = bf16.get(name)
        assert got.dtype == ml_dtypes.bfloat16 and np.array_equal(got, to_bf16(arr))
    assert json.loads((paths["nvfp4"] / "config.json").read_text())["model_type"] == "qwen3_moe"


def test_a_different_config_is_refused(trained):
    root, _ = trained
    other = Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    with pytest.raises(TrainerCheckpointError, match="do not fit"):
        list(trainer_checkpoint_tensors(root, other))


def test_cli_export_of_a_training_checkpoint(trained, tmp_path, capsys):
    # mixrl-convert reaches the trainer's reader only through the mixrl.convert entry point.
    from convert.cli import main

    root, models = trained
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CFG.to_hf_dict()))
    out = tmp_path / "bf16"
    assert main(["export", "--checkpoint", str(root), "--config", str(config), "--step", "3",
                 "--out", str(out), "--quiet"]) == 0
    got = HFCheckpoint(out)
    assert all(np.array_equal(got.get(n), to_bf16(a)) for n, a in models[3].items())
    assert main(["export", "--checkpoint", str(root), "--out", str(tmp_path / "x"),
                 "--quiet"]) == 1
    assert "stores no model config" in capsys.readouterr().err
