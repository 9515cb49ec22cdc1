"""Exports every loader accepts: projections a format's serving kernels cannot take stay bf16 and
are listed under each loader's ignore key; ``--strict`` refuses instead; transformers and the
mixrl engine load the mixed export.

The model is the issue's: a Qwen3 with ``intermediate_size`` 320, whose MLP projections
([320, 256] and [256, 320]) are not whole 128x128 blocks (transformers refused the old export with
"Weight shape (320, 256) not divisible by scale grid (3, 2)").
"""

import dataclasses
import json

import ml_dtypes
import numpy as np
import pytest

from convert.cli import main
from convert.export import export_hf
from convert.formats import (
    ShapeRuleError,
    excluded_modules,
    get_codec,
    shape_exclusions,
    stores_quantized,
)
from convert.hf_checkpoint import HFCheckpoint
from convert.qwen3_config import Qwen3Config, hf_tensor_shapes
from convert.verify import verify_dir

# q [256, 256], k/v [128, 256], o [256, 256]: whole blocks; gate/up [320, 256], down [256, 320]: not.
CFG = Qwen3Config(vocab_size=97, hidden_size=256, intermediate_size=320, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                  tie_word_embeddings=False)
MLP = [f"model.layers.{i}.mlp.{p}_proj" for i in range(2) for p in ("gate", "up", "down")]
ATTN = [f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo"]
# fp8 e4m3 keeps 3 mantissa bits (~2.6 % relative RMS per matrix, test_formats); errors of the
# 8 quantized attention matrices add roughly in quadrature, so the logits stay well inside 10 %.
FP8_LOGITS_REL_RMS = 0.10


def _params(cfg=CFG, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in hf_tensor_shapes(cfg).items():
        scale = 1.0 if name.endswith("norm.weight") else 0.05
        base = 1.0 if name.endswith("norm.weight") else 0.0
        out[name] = (base + rng.standard_normal(shape) * scale).astype(ml_dtypes.bfloat16)
    return out


def test_exclusions_per_format_and_fused_groups():
    fp8 = shape_exclusions(CFG, get_codec("fp8_block"))
    assert sorted(fp8) == sorted(MLP)
    assert "[320, 256]: fp8_block needs both dimensions multiples of 128" in fp8[MLP[0]]
    assert shape_exclusions(CFG, get_codec("fp8_block"), engines="mixrl") == {}
    assert shape_exclusions(CFG, get_codec("nvfp4")) == {}  # inputs 256 and 320 are 16-groups
    # intermediate 40: down_proj takes 40 inputs, not whole 16- or 32-groups
    odd = dataclasses.replace(CFG, **{"intermediate_size": 40})
    assert sorted(shape_exclusions(odd, get_codec("mxfp4"))) == \
        [f"model.layers.{i}.mlp.down_proj" for i in range(2)]
    assert sorted(shape_exclusions(odd, get_codec("nvfp4"))) == \
        [f"model.layers.{i}.mlp.down_proj" for i in range(2)]
    # A fused q/k/v whose k and v shards are not whole blocks: q stays bf16 with them, since
    # vLLM and SGLang refuse a fused layer whose shards disagree on quantization.
    gqa = dataclasses.replace(CFG, **{"intermediate_size": 256, "head_dim": 64,
                         "num_attention_heads": 4})
    assert sorted(shape_exclusions(gqa, get_codec("fp8_block"))) == sorted(
        f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkv")
    assert shape_exclusions(gqa, get_codec("w8a8_int8")) == {}  # in % 16 and out % 8 hold
    int8 = shape_exclusions(dataclasses.replace(CFG, intermediate_size=40), get_codec("w8a8_int8"))
    assert sorted(int8) == [f"model.layers.{i}.mlp.down_proj" for i in range(2)]
    assert "w8a8_int8 needs out a multiple of 8 and in of 16" in int8[sorted(int8)[0]]
    with pytest.raises(ShapeRuleError, match=r"^model\.layers\.0\.mlp\.gate_proj\.weight \[320, "
                                             r"256\]: fp8_block needs both dimensions multiples "
                                             r"of 128"):
        shape_exclusions(CFG, get_codec("fp8_block"), strict=True)


@pytest.mark.parametrize("fmt,key_sets", [
    ("fp8_block", ("modules_to_not_convert", "ignored_layers")),
    ("nvfp4", ("ignore", "exclude_modules")),
    ("mxfp4", ("modules_to_not_convert",)),
])
def test_mixed_export_lists_kept_layers_and_verifies(tmp_path, fmt, key_sets):
    cfg = dataclasses.replace(CFG, **{"intermediate_size": 40})  # breaks every rule
    codec = get_codec(fmt)
    kept = shape_exclusions(cfg, codec)
    assert kept
    out = export_hf(iter(_params(cfg).items()), cfg.to_hf_dict(), tmp_path / fmt, fmt)
    config = json.loads((out / "config.json").read_text())
    for key in key_sets:
        assert set(kept) <= set(config["quantization_config"][key]), key
    if fmt == "nvfp4":  # ModelOpt's exclude list in the nested file too
        hq = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
        assert set(kept) <= set(hq["exclude_modules"])
    assert excluded_modules(config) >= set(kept)
    ck = HFCheckpoint(out)
    for name in hf_tensor_shapes(cfg):
        if not name.endswith("_proj.weight"):
            continue
        module = name[: -len(".weight")]
        assert stores_quantized(name, config) == (module not in kept)
        if module in kept:
            assert ck.info(name)[0] == np.dtype(ml_dtypes.bfloat16)
            assert f"{module}.{codec.parts[1]}" not in ck
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["kept_bf16"]) == set(kept)
    verify_dir(out)  # verify reads the ignore lists: bf16 where listed, the format elsewhere


def test_cli_strict_refuses_in_one_line(tmp_path, capsys):
    from convert.hf_checkpoint import write_hf_checkpoint

    src = write_hf_checkpoint(tmp_path / "hf", iter(_params().items()), CFG.to_hf_dict())
    code = main(["quantize", "--in", str(src), "--format", "fp8_block", "--out",
                 str(tmp_path / "strict"), "--strict", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and not (tmp_path / "strict").exists()
    assert len(err.splitlines()) == 1
    assert "model.layers.0.mlp.gate_proj.weight [320, 256]: fp8_block needs both dimensions " \
           "multiples of 128" in err
    assert main(["quantize", "--in", str(src), "--format", "fp8_block", "--out",
                 str(tmp_path / "mixed"), "--quiet"]) == 0
    assert not stores_quantized("model.layers.0.mlp.gate_proj.weight",
                                HFCheckpoint(tmp_path / "mixed").config)


@pytest.fixture(scope="module")
def fp8_mixed(tmp_path_factory):
    from convert.hf_checkpoint import write_hf_checkpoint

    root = tmp_path_factory.mktemp("shapes")
    src = write_hf_checkpoint(root / "bf16", iter(_params().items()), CFG.to_hf_dict())
    ck = HFCheckpoint(src)
    out = export_hf(ck.tensors(), ck.config, root / "fp8", "fp8_block")
    return src, out


def test_transformers_loads_the_320_fp8_block_export(fp8_mixed):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers' FP8 loader needs it
    from convert.dequantize import dequantized_tensors

    src, out = fp8_mixed
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, CFG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, got = ref_model(ids).logits.float(), model(ids).logits.float()
    rel = float((got - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
    assert 0 < rel < FP8_LOGITS_REL_RMS  # > 0: the attention projections really are fp8
    # The kept MLP is the bf16 source bit for bit; the fp8 projections are our dequantization.
    deq = dict(dequantized_tensors(out))
    state = model.state_dict()
    for name in ("model.layers.0.mlp.gate_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        module = model.get_submodule(name[: -len(".weight")])
        if name in state and state[name].dtype == torch.bfloat16:
            loaded = state[name].float().numpy()
        else:  # a still-quantized FP8 module: dequantize its own tensors
            w, s = module.weight.float(), module.weight_scale_inv.float()
            full = s.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
            loaded = (w * full).numpy()
        expected = deq[name].astype(ml_dtypes.bfloat16).astype(np.float32) \
            if "mlp" not in name else deq[name]
        np.testing.assert_array_equal(loaded, expected, err_msg=name)


def test_mixrl_engine_loads_the_mixed_export(fp8_mixed):
    torch = pytest.importorskip("torch")
    from sampler_torch.recipes import get_recipe
    from sampler_torch.recipes.loader import load_model

    src, out = fp8_mixed
    ref = load_model(src, get_recipe("bf16")).model
    mixed = load_model(out, get_recipe("fp8"))
    assert type(mixed.model.model.layers[0].mlp.gate_proj) is torch.nn.Linear
    assert type(mixed.model.model.layers[0].self_attn.q_proj) is not torch.nn.Linear
    ids = torch.randint(0, CFG.vocab_size, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = ref(ids).float(), mixed.model(ids).float()
    rel = float((b - a).pow(2).mean().sqrt() / a.pow(2).mean().sqrt())
    # The engine's fp8 recipe also rounds activations to e4m3 per token group, about doubling
    # the weight-only error (measured 12 %).
    assert 0 < rel < 2 * FP8_LOGITS_REL_RMS


# The conformance table's transformers column (convert/README.md), on this CPU.
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_transformers_refuses_nvfp4_and_dense_mxfp4(fp8_mixed, tmp_path, fmt):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    ck = HFCheckpoint(fp8_mixed[0])
    out = export_hf(ck.tensors(), ck.config, tmp_path / fmt, fmt)
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):  # packed [out, in/2]
        transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)


def test_transformers_reads_w8a8_int8_without_its_scales(fp8_mixed, tmp_path):
    """SGLang's w8a8_int8 quant_method is unknown to transformers, which then loads the int8
    codes as plain weights and drops weight_scale: a silently wrong model, so the table marks it
    refused (the compressed-tensors layout is the int8 export transformers reads)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    ck = HFCheckpoint(fp8_mixed[0])
    out = export_hf(ck.tensors(), ck.config, tmp_path / "int8", "w8a8_int8")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    assert float(model.model.layers[0].self_attn.q_proj.weight.abs().max()) == 127.0
