"""Both halves of the system reproduce transformers' Qwen3 / Qwen3-MoE logits from its own files."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from tiny_models import ALL_CONFIGS

import sampler_torch.models as torch_models
import trainer_jax.models as jax_models

TOL = 1e-4


def _ids(vocab: int, shape=(2, 13), seed=0):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, vocab, shape))


def _reference_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float().numpy()


JAX_CASES = [(name, None) for name in sorted(ALL_CONFIGS)] + [
    (name, "ragged_dot") for name in sorted(ALL_CONFIGS) if "moe" in name]


@pytest.mark.parametrize("name, moe_impl", JAX_CASES)
def test_jax_logits_match_transformers(hf_model_dir, name, moe_impl):
    path, hf = hf_model_dir(name)
    ids = _ids(hf.config.vocab_size)
    model, cfg = jax_models.load_hf(path, dtype=jnp.float32, moe_impl=moe_impl)
    assert cfg.is_moe == ("moe" in name)
    logits = np.asarray(model(jnp.asarray(ids.numpy(), jnp.int32)))
    assert logits.shape == (2, 13, hf.config.vocab_size)
    np.testing.assert_allclose(logits, _reference_logits(hf, ids), atol=TOL, rtol=0)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("name", sorted(ALL_CONFIGS))
def test_torch_logits_match_transformers(hf_model_dir, name, attention):
    path, hf = hf_model_dir(name)
    ids = _ids(hf.config.vocab_size)
    model = torch_models.load_hf(path, dtype=torch.float32)
    model.set_attention_impl(attention)
    with torch.no_grad():
        logits = model(ids).numpy()
    np.testing.assert_allclose(logits, _reference_logits(hf, ids), atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ["dense_untied_gqa4", "moe_sparse_step2_unnormed"])
def test_kv_cache_decoding_matches_full_forward(hf_model_dir, name):
    path, hf = hf_model_dir(name)
    model = torch_models.load_hf(path)
    ids = _ids(hf.config.vocab_size, (3, 12), seed=1)
    with torch.no_grad():
        full = model(ids)
        # Rows start from different prompt lengths (right padding), then decode one token at a time.
        prompt_lens = torch.tensor([4, 7, 5])
        cache = torch_models.KVCache.for_model(model.config, slots=3, max_len=16)
        padded = ids[:, :7].clone()
        model(padded, cache=cache)
        pos = prompt_lens.clone()
        while int(pos.min()) < 12:
            rows = torch.nonzero(pos < 12)[:, 0]
            step = model(ids[rows, pos[rows]][:, None], positions=pos[rows][:, None], cache=cache, slots=rows)
            for j, r in enumerate(rows.tolist()):
                np.testing.assert_allclose(step[j, 0].numpy(), full[r, pos[r]].numpy(), atol=TOL, rtol=0)
            pos[rows] += 1


def test_kv_cache_slot_reuse_ignores_previous_occupant(hf_model_dir):
    path, hf = hf_model_dir("dense_tied_gqa2")
    model = torch_models.load_hf(path)
    a, b = _ids(hf.config.vocab_size, (1, 10), seed=2), _ids(hf.config.vocab_size, (1, 6), seed=3)
    with torch.no_grad():
        cache = torch_models.KVCache.for_model(model.config, slots=2, max_len=12)
        model(a, cache=cache, slots=torch.tensor([1]))  # fill slot 1 with a longer sequence
        reused = model(b, cache=cache, slots=torch.tensor([1]))  # then reuse it for a shorter one
        np.testing.assert_allclose(reused.numpy(), model(b).numpy(), atol=TOL, rtol=0)


def test_jax_packed_segments_equal_separate_sequences(hf_model_dir):
    path, hf = hf_model_dir("moe_mlp_only_layers")
    model, _ = jax_models.load_hf(path)
    s1, s2 = _ids(hf.config.vocab_size, (1, 7), seed=4), _ids(hf.config.vocab_size, (1, 5), seed=5)
    packed = jnp.asarray(np.concatenate([s1.numpy(), s2.numpy(), np.zeros((1, 3), np.int64)], 1), jnp.int32)
    segments = jnp.asarray([[1] * 7 + [2] * 5 + [0] * 3], jnp.int32)
    out = np.asarray(model(packed, segment_ids=segments))
    np.testing.assert_allclose(out[0, :7], np.asarray(model(jnp.asarray(s1.numpy())))[0], atol=TOL)
    np.testing.assert_allclose(out[0, 7:12], np.asarray(model(jnp.asarray(s2.numpy())))[0], atol=TOL)
    assert np.isfinite(out).all()


def test_jax_bf16_compute_close_to_fp32(hf_model_dir):
    path, hf = hf_model_dir("dense_untied_gqa4")
    ids = jnp.asarray(_ids(hf.config.vocab_size).numpy(), jnp.int32)
    fp32, _ = jax_models.load_hf(path)
    bf16, _ = jax_models.load_hf(path, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    diff = np.abs(np.asarray(bf16(ids)) - np.asarray(fp32(ids)))
    assert 0 < diff.max() < 0.1  # differs (really bf16) but stays close on a 3-layer model
