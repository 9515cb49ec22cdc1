"""The engine's forward (fused projections, per-forward RoPE/mask, cache views) computes what
``sampler_torch.models.Qwen3ForCausalLM`` computes."""

import numpy as np
import pytest
import torch

from sampler_torch.engine.forward import EngineForward
from sampler_torch.models import KVCache
from sampler_torch.recipes import get_recipe, load_model


def _ids(vocab, shape, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, vocab, shape))


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("name", ["dense_untied_gqa4", "dense_tied_gqa2", "moe_sparse_step2_unnormed"])
def test_fp32_forward_equals_the_model(hf_model_dir, name, attention):
    path, _ = hf_model_dir(name)
    recipe = get_recipe("bf16", compute_dtype="float32", attention=attention)
    model = load_model(path, recipe).model
    fwd = EngineForward(model, recipe)
    ids = _ids(model.config.vocab_size, (2, 9))
    with torch.no_grad():
        expected = model(ids)
    np.testing.assert_allclose(fwd.logits(fwd.hidden(ids)), expected, atol=1e-5, rtol=0)
    # Through the cache: a right-padded prefill of two slots, then one decode step each.
    cache = KVCache.for_model(model.config, slots=3, max_len=12)
    lens = [5, 7]
    fwd.hidden(ids[:, :7], cache=cache, slots=torch.tensor([2, 0]))
    pos = torch.tensor([[lens[0]], [lens[1]]])
    step = fwd.logits(fwd.hidden(ids[[0, 1], [5, 7]][:, None], pos, cache=cache,
                                 slots=torch.tensor([2, 0])))
    np.testing.assert_allclose(step[0, 0], expected[0, 5], atol=1e-5, rtol=0)
    np.testing.assert_allclose(step[1, 0], expected[1, 7], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kernel", ["auto", "native"])
def test_bf16_forward_matches_the_bf16_model(hf_model_dir, kernel):
    """bf16 operands through float32 GEMM (``auto`` on CPU) or the bf16 GEMM (``native``): the
    same products and float32 accumulation, so only summation order and the resulting bf16
    roundings differ from the model's own bf16 forward."""
    path, _ = hf_model_dir("dense_untied_gqa4")
    recipe = get_recipe("bf16", kernel=kernel)
    model = load_model(path, recipe).model
    fwd = EngineForward(model, recipe)
    assert fwd.layers[0]["qkv"].weight.dtype == (torch.float32 if kernel == "auto"
                                                  else torch.bfloat16)
    ids = _ids(model.config.vocab_size, (2, 9))
    with torch.no_grad():
        expected = model(ids)
        ref32 = load_model(path, get_recipe("bf16", compute_dtype="float32")).model(ids)
    got = fwd.logits(fwd.hidden(ids))
    err, model_err = (got - ref32).abs().max(), (expected - ref32).abs().max()
    assert err < 2 * model_err + 1e-3, (err, model_err)
    np.testing.assert_allclose(got, expected, atol=0.03, rtol=0)


@pytest.mark.slow  # two torch.compile runs: ~20-40 s on this CPU
def test_compiled_decode_generates_what_the_eager_engine_does(hf_model_dir):
    """``Engine(compile=True)``: static-shape compiled decode and sampling, fp32 -- the same
    tokens and records as the eager engine, through slot refills and mixed truncation."""
    from sampler_torch.engine import Engine, SamplingParams

    path, _ = hf_model_dir("dense_tied_gqa2")
    params = [SamplingParams(max_new_tokens=n, top_p=p, seed=i, head_k=4)
              for i, (n, p) in enumerate([(5, 1.0), (9, 1.0), (4, 0.9), (6, 1.0)])]
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    outs = {}
    for compiled in (False, True):
        eng = Engine(path, "bf16", compute_dtype="float32", max_batch=2, compile=compiled)
        outs[compiled] = eng.generate(prompts, params)
    for a, b in zip(outs[False], outs[True], strict=True):
        assert a.token_ids == b.token_ids and a.head_ids == b.head_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        np.testing.assert_allclose(a.logprobs_full, b.logprobs_full, atol=1e-5)
        assert a.support_ids == b.support_ids


class _GeneralPathCache(KVCache):
    """A plain cache under another type: ``EngineForward.hidden`` takes its general per-layer
    ``write``/``read`` loop for it, not the one-token ``decode`` step."""


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kernel", ["auto", "native"])
def test_one_token_decode_step_computes_what_the_general_path_does(hf_model_dir, kernel,
                                                                   cache_dtype):
    """bf16 compute: ``decode`` (a decode step's fast path) against the general loop, through
    a contiguous run of slots (cache views) and a gathered set, in a bf16 cache and in the
    float32 cache the eager engine stores bf16 keys/values in. Probabilities @ values run as the
    float32 GEMM on the ``auto`` kernel (bf16 products are exact in float32; only the summation
    order can differ from the bf16 GEMM), so the logits agree to a bf16 rounding there and
    exactly on ``native``."""
    path, _ = hf_model_dir("dense_untied_gqa4")
    recipe = get_recipe("bf16", kernel=kernel, attention="eager")
    model = load_model(path, recipe).model
    fwd = EngineForward(model, recipe)
    ids = _ids(model.config.vocab_size, (3, 12), seed=3)
    steps = [(torch.tensor([1, 2, 3]), torch.tensor([[7], [5], [7]]), ids[:, 7:8]),
             (torch.tensor([3, 1]), torch.tensor([[8], [8]]), ids[[2, 0], 8:9])]
    got = {}
    # the general loop in the recipe's bf16 cache: what the engine's float32 cache stands in for
    runs = [(KVCache, cache_dtype), (_GeneralPathCache, cache_dtype),
            (_GeneralPathCache, torch.bfloat16)]
    for cls, dtype in runs:
        cache = cls.for_model(model.config, slots=4, max_len=12, dtype=dtype)
        assert fwd.fast_decode(cache) == (cls is KVCache)
        fwd.hidden(ids[:, :7], cache=cache, slots=torch.tensor([1, 2, 3]))
        got[cls, dtype] = [fwd.logits(fwd.hidden(tok, pos, cache=cache, slots=slots))[:, 0]
                           for slots, pos, tok in steps]
        got[cls, dtype] += [torch.stack(cache.k).float(), torch.stack(cache.v).float()]
    for reference in runs[1:]:
        for fast, general in zip(got[runs[0]], got[reference], strict=True):
            if kernel == "native":
                assert torch.equal(fast, general)
            else:
                torch.testing.assert_close(fast, general, atol=2e-2, rtol=0)
    with pytest.raises(ValueError, match="past the cache length"):
        fwd.hidden(ids[:1, :1], torch.tensor([[12]]), cache=KVCache.for_model(
            model.config, slots=1, max_len=12, dtype=cache_dtype), slots=torch.tensor([0]))


def test_rms_norm_of_bf16_rounds_once_as_the_float32_norm_then_a_cast():
    """``forward._rms`` hands ``F.rms_norm`` the bf16 tensor itself: that must be the float32
    normalisation rounded once to bf16 (``models.qwen3.RMSNorm``'s ``normed.to(x.dtype)``), at
    every scale and for rows with one dominant entry (a torch that normalised in bf16 fails)."""
    import torch.nn.functional as F

    from sampler_torch.engine.forward import _rms

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=gen) * torch.logspace(-3, 3, 64)[:, None]
    x[::7, 3] *= 300
    x = x.bfloat16()
    w = torch.randn(96, generator=gen).bfloat16()
    for eps in (1e-6, 1e-2):
        want = w * F.rms_norm(x.float(), (96,), eps=eps).to(torch.bfloat16)
        assert torch.equal(_rms(x, w, eps), want)


@pytest.mark.parametrize("kernel", ["auto", "native"])
def test_aligned_decode_stores_through_a_view_what_the_general_path_stores(hf_model_dir, kernel):
    """``decode(aligned=True, read=slice)`` (the engine's steady step: a contiguous run of slots
    all at one position) writes keys/values through a cache view: the same cache contents and
    logits as the general loop's ``write``/``read``."""
    path, _ = hf_model_dir("dense_untied_gqa4")
    recipe = get_recipe("bf16", kernel=kernel, attention="eager")
    model = load_model(path, recipe).model
    fwd = EngineForward(model, recipe)
    ids = _ids(model.config.vocab_size, (2, 7), seed=4)
    slots = torch.tensor([1, 2])
    got = {}
    for cls in (KVCache, _GeneralPathCache):
        cache = cls.for_model(model.config, slots=4, max_len=10, dtype=torch.bfloat16)
        fwd.hidden(ids[:, :6], cache=cache, slots=slots)
        pos = torch.tensor([6, 6])
        if cls is KVCache:
            h = fwd.decode(ids[:, 6], pos, cache, slots, length=7, read=slice(1, 3), aligned=True)
        else:
            h = fwd.hidden(ids[:, 6:7], pos[:, None], cache=cache, slots=slots)[:, 0]
        got[cls] = [fwd.logits(h), torch.stack(cache.k).float(), torch.stack(cache.v).float()]
    for fast, general in zip(got[KVCache], got[_GeneralPathCache], strict=True):
        if kernel == "native":
            assert torch.equal(fast, general)
        else:
            torch.testing.assert_close(fast, general, atol=2e-2, rtol=0)
    assert got[KVCache][1][:, 1:3, :, 6].abs().sum() > 0  # the new keys landed at position 6
