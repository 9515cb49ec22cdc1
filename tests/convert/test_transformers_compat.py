"""transformers loads our exports: bf16 gives the original logits, fp8_block loads natively.

Reference logits come from the original checkpoint loaded with ``from_pretrained`` (not the
in-memory model: ``.to(bfloat16)`` would also round the rotary ``inv_freq`` buffer, which a
fresh load recomputes in float32).
"""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import numpy as np  # noqa: E402
from tiny_models import build_hf_model  # noqa: E402

from convert.dequantize import dequantized_tensors, plain_config  # noqa: E402
from convert.export import export_hf  # noqa: E402
from convert.hf_checkpoint import HFCheckpoint, write_hf_checkpoint  # noqa: E402
from convert.verify import verify_dir  # noqa: E402

MODELS = ["dense_untied_gqa4", "dense_tied_gqa2", "moe_norm_topk", "moe_sparse_step2_unnormed"]

# fp8_block vs bf16 logits: e4m3 keeps 3 mantissa bits, a per-matrix relative RMS weight error
# of ~2.6 % (measured in test_formats); through 2-4 layers of ~7 matrices whose errors add
# roughly in quadrature, the logits' relative RMS error stays below 4x that. Measured: 2-5 %.
FP8_LOGITS_REL_RMS = 0.10
# 4-bit formats lose ~10 % RMS per matrix (measured logits error 6-23 % on these tiny random
# models); int8 ~0.8 % per matrix (measured 0.7-1.5 %). The bounds are loose on purpose: they
# prove the dequantized model is the same model, since a wrong layout, transposition, nibble
# order or scale gives O(1) errors.
FP4_LOGITS_REL_RMS = 0.35
INT8_LOGITS_REL_RMS = 0.05


def _load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


def _rel_rms(a, b):
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


@pytest.fixture(scope="module", params=MODELS)
def original(request, tmp_path_factory):
    src = tmp_path_factory.mktemp(request.param) / "hf"
    build_hf_model(request.param).to(torch.bfloat16).save_pretrained(src)
    model = _load(src)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    return src, ids, _logits(model, ids)


def _export(src, out, fmt):
    hf = HFCheckpoint(src)
    export_hf(hf.tensors(), hf.config, out, fmt, copy_files_from=src)
    verify_dir(out)
    return out


def test_bf16_export_gives_identical_logits(original, tmp_path):
    src, ids, ref = original
    out = _export(src, tmp_path / "bf16", "bf16")
    assert torch.equal(_logits(_load(out), ids), ref)


def test_fp8_block_loads_natively_and_matches_our_dequantization(original, tmp_path):
    pytest.importorskip("accelerate")  # transformers' FP8 loader needs it
    src, ids, ref = original
    out = _export(src, tmp_path / "fp8", "fp8_block")
    native = _logits(_load(out), ids)  # transformers dequantizes FP8 to bf16 on CPU
    ours = tmp_path / "fp8_dequantized"
    write_hf_checkpoint(ours, dequantized_tensors(out), plain_config(HFCheckpoint(out).config))
    # Same weights bit for bit (our dequantize rounded to bf16 == transformers' Fp8Dequantize).
    assert torch.equal(_logits(_load(ours), ids), native)
    assert _rel_rms(native, ref) < FP8_LOGITS_REL_RMS


@pytest.mark.parametrize("fmt,tol", [("nvfp4", FP4_LOGITS_REL_RMS), ("mxfp4", FP4_LOGITS_REL_RMS),
                                     ("w8a8_int8", INT8_LOGITS_REL_RMS)])
def test_dequantized_exports_stay_close(original, tmp_path, fmt, tol):
    src, ids, ref = original
    out = _export(src, tmp_path / fmt, fmt)
    deq = tmp_path / f"{fmt}_dequantized"
    write_hf_checkpoint(deq, dequantized_tensors(out), plain_config(HFCheckpoint(out).config))
    got = _logits(_load(deq), ids)
    assert np.isfinite(got.numpy()).all()
    assert _rel_rms(got, ref) < tol
