"""The CPU's ``kernel: auto`` for bf16 picks the GEMM per projection (issue 49 item 3): the bf16
GEMM from ``_BF16_GEMM_MIN`` weight elements, the float32 GEMM of the same bf16 operands below.
Both are bf16 products summed in float32 and rounded to bf16, so the mixed forward agrees with
the all-bf16-GEMM one (``kernel: native``) to bf16 roundings; the engine's records are those of
the distribution it samples; an in-place reload writes each fused copy in its own dtype."""

import numpy as np
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from convert.export import export_hf
from convert.hf_checkpoint import HFCheckpoint
from sampler_torch.engine import Engine, SamplingParams
from sampler_torch.engine.forward import _BF16_GEMM_MIN, EngineForward
from sampler_torch.recipes import get_recipe, load_model

# hidden 256: q/k/v (131,072 elements), o, gate/up and lm_head (65,536) reach the bf16 GEMM's
# threshold, down (128 x 256 = 32,768) stays on the float32 GEMM
CFG = dict(vocab_size=256, hidden_size=256, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=8, num_key_value_heads=4, head_dim=32, tie_word_embeddings=False)


def _export(root, seed: int):
    torch.manual_seed(seed)
    Qwen3ForCausalLM(Qwen3Config(**CFG)).eval().save_pretrained(root / f"src{seed}")
    src = HFCheckpoint(root / f"src{seed}")
    return export_hf(src.tensors(), src.config, root / f"bf16_{seed}", "bf16")


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemm_choice")
    return [_export(root, 0), _export(root, 1)]


def test_auto_picks_the_gemm_by_weight_size(exports):
    assert 256 * 256 == _BF16_GEMM_MIN
    model = load_model(exports[0], get_recipe("bf16")).model
    fwd = EngineForward(model, get_recipe("bf16"))
    lyr = fwd.layers[0]
    assert fwd.sgemm  # attention products and the KV cache stay float32 on the eager path
    assert lyr["qkv"].weight.dtype == lyr["o"].weight.dtype == torch.bfloat16
    assert lyr["gate_up"].weight.dtype == fwd.lm_head.weight.dtype == torch.bfloat16
    assert lyr["down"].weight.dtype == torch.float32


def test_mixed_gemms_match_the_bf16_gemm(exports):
    """The mixed forward against ``kernel: native`` (every projection on the bf16 GEMM) and the
    float32 model: the same error against float32 as the bf16 model's own, and equal logits up
    to bf16 roundings."""
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, CFG["vocab_size"], (2, 9)))
    got = {}
    for kernel in ("auto", "native"):
        recipe = get_recipe("bf16", kernel=kernel)
        fwd = EngineForward(load_model(exports[0], recipe).model, recipe)
        got[kernel] = fwd.logits(fwd.hidden(ids))
    ref32 = load_model(exports[0], get_recipe("bf16", compute_dtype="float32")).model(ids)
    err, native_err = ((got[k] - ref32).abs().max() for k in ("auto", "native"))
    assert err < 2 * native_err + 1e-3, (err, native_err)
    np.testing.assert_allclose(got["auto"], got["native"], atol=0.03, rtol=0)


def test_default_engine_records_the_distribution_it_samples(exports):
    """The default engine (one-token decode, mixed GEMMs, float32 cache): every token's
    ``logprobs_full`` is its log-probability under the teacher-forced logits (bf16 roundings
    apart), ``logprobs`` equals it when nothing truncates, and the head is that distribution's."""
    eng = Engine(exports[0], "bf16", max_batch=3)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=8, head_k=5, seed=3))
    agree = total = 0
    for prompt, c in zip(prompts, outs, strict=True):
        logq = torch.log_softmax(eng.logits([prompt + c.token_ids])[0][len(prompt) - 1: -1], -1)
        got = torch.tensor(c.logprobs_full)
        np.testing.assert_allclose(got, logq.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0],
                                   atol=0.05)
        assert c.logprobs == c.logprobs_full
        agree += sum(h == logq[t].topk(5).indices.tolist() for t, h in enumerate(c.head_ids))
        total += len(c.head_ids)
    assert agree >= 0.75 * total, (agree, total)


def test_in_place_reload_writes_every_gemm_dtype(exports):
    """A reload into the mixed forward (bf16 and float32 fused copies) gives a fresh load's
    logits exactly."""
    seqs = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    eng = Engine(exports[0], "bf16", max_batch=2)
    eng.load_weights(exports[1], version=1)
    fresh = Engine(exports[1], "bf16", max_batch=2)
    for a, b in zip(eng.logits(seqs), fresh.logits(seqs), strict=True):
        assert torch.equal(a, b)
    assert eng.weights_digest() == fresh.weights_digest()
