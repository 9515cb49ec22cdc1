"""JAX save -> transformers load is exact, sharded directories load, bad checkpoints are refused."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from tiny_models import ALL_CONFIGS
from transformers import AutoModelForCausalLM

import trainer_jax.models as jax_models
from convert.hf_checkpoint import CheckpointError, HFCheckpoint


@pytest.mark.parametrize("name", sorted(ALL_CONFIGS))
def test_save_then_transformers_load_is_exact(hf_model_dir, tmp_path, name):
    path, hf = hf_model_dir(name)
    model, cfg = jax_models.load_hf(path)
    out = jax_models.save_hf(model, cfg, tmp_path / "export")
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    original = hf.state_dict()
    for key, value in reloaded.state_dict().items():
        assert torch.equal(value, original[key]), key
    ids = torch.randint(0, hf.config.vocab_size, (2, 9))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, hf(ids).logits)


def test_sharded_save_round_trips(hf_model_dir, tmp_path):
    path, hf = hf_model_dir("moe_sparse_step2_unnormed")
    model, cfg = jax_models.load_hf(path)
    out = jax_models.save_hf(model, cfg, tmp_path / "sharded", max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    again, _ = jax_models.load_hf(out)
    ids = jnp.asarray(np.arange(12).reshape(2, 6) % cfg.vocab_size, jnp.int32)
    assert np.array_equal(np.asarray(again(ids)), np.asarray(model(ids)))
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert torch.equal(reloaded.state_dict()["lm_head.weight"], hf.state_dict()["lm_head.weight"])


def test_bf16_save_is_loaded_as_bf16(hf_model_dir, tmp_path):
    path, hf = hf_model_dir("dense_tied_gqa2")
    model, cfg = jax_models.load_hf(path)
    out = jax_models.save_hf(model, cfg, tmp_path / "bf16", dtype="bfloat16")
    ckpt = HFCheckpoint(out)
    assert all(ckpt.info(n)[0].name == "bfloat16" for n in ckpt.names())
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.dtype == torch.bfloat16


def test_save_refuses_to_overwrite_and_leaves_no_partial_dir(hf_model_dir, tmp_path):
    path, _ = hf_model_dir("dense_tied_gqa2")
    model, cfg = jax_models.load_hf(path)
    out = jax_models.save_hf(model, cfg, tmp_path / "once")
    with pytest.raises(FileExistsError):
        jax_models.save_hf(model, cfg, out)
    with pytest.raises(ValueError, match="dtype"):
        jax_models.save_hf(model, cfg, tmp_path / "bad", dtype="int4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["once"]


def test_load_rejects_shape_mismatch_and_missing_files(hf_model_dir, tmp_path):
    path, _ = hf_model_dir("dense_tied_gqa2")
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in path.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bad / "config.json").read_text())
    cfg["hidden_size"] = 64
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="shape"):
        jax_models.load_hf(bad)
    with pytest.raises(CheckpointError, match="not a directory"):
        jax_models.load_hf(tmp_path / "does_not_exist")
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    (weightless / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        jax_models.load_hf(weightless)
