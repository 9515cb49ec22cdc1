"""Issue 48 item 2: the quantization-shaped dial (``round_weights: {bits: K, block_size: B}``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mixrl_wire.recipes import RecipeError, get_recipe
from sampler_torch.recipes import load_model
from sampler_torch.recipes.rounding import RoundWeights, check_recipe, round_blockwise


def _reference(w: np.ndarray, bits: int, block: int) -> np.ndarray:
    """Row by row, block by block, in float32 like the sampler's arithmetic."""
    w = w.astype(np.float32)
    qmax = np.float32(2 ** (bits - 1) - 1)
    out = np.zeros_like(w)
    for i in range(w.shape[0]):
        for start in range(0, w.shape[1], block):
            blk = w[i, start:start + block]
            scale = np.float32(np.max(np.abs(blk))) / qmax
            if scale == 0:
                continue
            q = np.clip(np.round(blk / scale), -qmax, qmax)
            out[i, start:start + block] = (q * scale).astype(np.float32)
    return out


@pytest.mark.parametrize("bits,block", [(8, 16), (4, 16), (3, 7), (2, 64), (5, 50)])
def test_rounding_matches_a_numpy_reference(bits, block):
    rng = np.random.default_rng(bits * 100 + block)
    w = rng.normal(size=(6, 50)).astype(np.float32)  # 50 = 3 x 16 + a tail of 2 for B = 16
    w[1, :16] = 0.0  # an all-zero block stays zero
    got = round_blockwise(torch.from_numpy(w), RoundWeights(bits, block)).numpy()
    want = _reference(w, bits, block)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert not np.any(got[1, :16])
    # Each block holds at most 2^K - 1 levels, and the block maximum is kept exactly.
    for i in range(6):
        for start in range(0, 50, block):
            blk = got[i, start:start + block]
            assert len(np.unique(blk)) <= 2**bits - 1
            orig = w[i, start:start + block]
            assert np.max(np.abs(blk)) == pytest.approx(np.max(np.abs(orig)), rel=1e-6)


def test_bf16_weights_round_and_keep_their_dtype():
    w = torch.randn(4, 33, dtype=torch.bfloat16)
    out = round_blockwise(w, RoundWeights(4, 8))
    assert out.dtype == torch.bfloat16
    np.testing.assert_allclose(out.float().numpy(),
                               _reference(w.float().numpy(), 4, 8).astype(np.float32), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("kw,match", [(dict(bits=1, block_size=8), "bits must be in 2..8"),
                                      (dict(bits=9, block_size=8), "bits must be in 2..8"),
                                      (dict(bits=4, block_size=0), "block_size must be > 0"),
                                      (dict(bits=4.0, block_size=8), "bits must be an integer")])
def test_spec_validation(kw, match):
    with pytest.raises(RecipeError, match=match):
        RoundWeights(**kw)


def test_recipes_with_quantized_activations_are_refused():
    check_recipe(get_recipe("bf16"))
    check_recipe(get_recipe("nvfp4_w4a16"))
    for name in ("fp8", "nvfp4_w4a4", "int8"):
        with pytest.raises(RecipeError, match="round_weights needs a recipe that computes with float"):
            check_recipe(get_recipe(name))


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


def test_load_rounds_projections_only_and_mismatch_grows_as_bits_fall(hf_model_dir):
    path, _ = hf_model_dir("dense_untied_gqa4")
    recipe = get_recipe("bf16", compute_dtype="float32")
    clean = load_model(path, recipe).model
    ids = torch.randint(0, 131, (4, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        base = clean(ids)
    kls = {}
    for bits in (8, 6, 4, 3):
        spec = RoundWeights(bits, 16)
        rounded = load_model(path, recipe, round_weights=spec).model
        q = rounded.model.layers[1].self_attn.q_proj.weight
        torch.testing.assert_close(q, round_blockwise(clean.model.layers[1].self_attn.q_proj.weight, spec))
        down = rounded.model.layers[2].mlp.down_proj.weight
        torch.testing.assert_close(down, round_blockwise(clean.model.layers[2].mlp.down_proj.weight, spec))
        # Embeddings, lm_head and norms are not quantizable projections: untouched.
        assert torch.equal(rounded.lm_head.weight, clean.lm_head.weight)
        assert torch.equal(rounded.model.embed_tokens.weight, clean.model.embed_tokens.weight)
        assert torch.equal(rounded.model.norm.weight, clean.model.norm.weight)
        with torch.inference_mode():
            kls[bits] = _kl(base, rounded(ids))
    assert 0 < kls[8] < kls[6] < kls[4] < kls[3], kls
    assert kls[3] > 30 * kls[8], kls


def test_engine_rounds_at_load_and_recomputes_scales_at_every_reload(tmp_path):
    """An engine whose recipe carries the dial serves rounded weights; a reload rounds the new
    version with its own scales (compared with a reference loaded alone, not with the old one)."""
    from tiny_models import build_hf_model

    from convert.export import export_hf
    from convert.hf_checkpoint import HFCheckpoint
    from sampler_torch.engine import Engine
    from sampler_torch.recipes.rounding import with_round_weights

    dirs = {}
    for version in (0, 1):
        build_hf_model("dense_tied_gqa2", seed=version).save_pretrained(tmp_path / f"src{version}")
        ckpt = HFCheckpoint(tmp_path / f"src{version}")
        dirs[version] = export_hf(ckpt.tensors(), ckpt.config, tmp_path / f"v{version}", "bf16",
                                  engines="mixrl")
    recipe = get_recipe("bf16", compute_dtype="float32")
    spec = RoundWeights(3, 8)
    engine = Engine(dirs[0], with_round_weights(recipe, spec))
    prompts, conts = [[1, 2, 3], [4, 5]], [[6, 7, 8, 9], [10, 11, 12]]

    def reference(path, rounded: bool) -> list[list[float]]:
        model = load_model(path, recipe, round_weights=spec if rounded else None).model
        out = []
        for p, c in zip(prompts, conts, strict=True):
            with torch.inference_mode():
                lp = torch.log_softmax(model(torch.tensor([p + c]))[0].double(), -1)
            out.append([float(lp[len(p) - 1 + t, x]) for t, x in enumerate(c)])
        return out

    def close(a, b, tol):
        return np.allclose(np.concatenate(a), np.concatenate(b), atol=tol)

    for version in (0, 1):
        if version:
            engine.load_weights(dirs[1], 1)  # score() uses the newest load
        got = engine.score(prompts, conts)
        assert close(got, reference(dirs[version], True), 1e-4)
        assert not close(got, reference(dirs[version], False), 1e-3)  # the dial is on
    with pytest.raises(RecipeError, match="quantizes activations"):
        with_round_weights(get_recipe("fp8"), spec)
