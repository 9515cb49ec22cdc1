"""Streaming exports, publish layout and atomicity, keep_last, verify and corrupt inputs."""

import json
import os
import threading

import ml_dtypes
import numpy as np
import pytest

from convert.export import ExportError, export_hf, kv_scale_names
from convert.formats import FORMATS, QuantizationError, get_codec
from convert.hf_checkpoint import HFCheckpoint, write_hf_checkpoint
from convert.manifest import check_manifest
from convert.orbax_io import OrbaxCheckpoint, save_orbax
from convert.publish import LATEST, latest_version, list_versions, publish
from convert.qwen3_config import Qwen3Config, hf_tensor_shapes
from convert.sources import SourceError
from convert.verify import VerifyError, verify_dir

MOE = Qwen3Config(vocab_size=300, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=96, decoder_sparse_step=2)


def make_params(cfg=MOE, seed=0):
    rng = np.random.default_rng(seed)
    return {n: (rng.standard_normal(s) * 0.02).astype(ml_dtypes.bfloat16)
            for n, s in hf_tensor_shapes(cfg).items()}


def leftovers(root):
    """Temp or aside directories an aborted write would leave."""
    return [p for p in os.listdir(root) if p.startswith(".")]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_export_writes_what_verify_accepts(tmp_path, fmt):
    params = make_params()
    # engines="mixrl": every projection in fmt, partial edge blocks included (192 rows)
    out = export_hf(iter(params.items()), MOE.to_hf_dict(), tmp_path / fmt, fmt, engines="mixrl",
                    max_shard_bytes=64 * 1024)
    report = verify_dir(out)
    assert report.format == fmt and report.files > 1  # several shards, one index
    config = json.loads((out / "config.json").read_text())
    qc = config.get("quantization_config")
    assert (qc is None) == (fmt == "bf16")
    if qc is not None:
        ignored = set(qc.get("modules_to_not_convert") or qc.get("ignore"))
        # router of the sparse layer (1) unquantized, dense layer 0's gate_proj quantized
        assert {"lm_head", "model.embed_tokens", "model.layers.1.mlp.gate"} <= ignored
        assert "model.layers.0.mlp.gate" not in ignored
    if fmt == "nvfp4":
        hq = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
        assert hq["quant_algo"] == "NVFP4" and hq["group_size"] == 16
        assert hq["exclude_modules"] == qc["exclude_modules"]
    ck = HFCheckpoint(out)
    assert ck.info("model.layers.1.mlp.gate.weight")[0] == np.dtype(ml_dtypes.bfloat16)
    assert ck.info("model.norm.weight")[0] == np.dtype(ml_dtypes.bfloat16)
    codec = get_codec(fmt)
    for suffix, (dtype, shape) in codec.tensor_specs((192, 128)).items():
        assert ck.info(f"model.layers.0.mlp.up_proj.{suffix}") == (dtype, shape)


def test_export_refuses_bad_sources_and_leaves_nothing(tmp_path):
    params = make_params()
    cfg = MOE.to_hf_dict()

    def without(name):
        return ((n, a) for n, a in params.items() if n != name)

    cases = [
        (without("model.layers.1.mlp.experts.3.down_proj.weight"), ExportError, "lacks 1"),
        (list(params.items()) + [("model.extra.weight", np.zeros(2, np.float32))], ExportError,
         "not part of"),
        ({**params, "model.norm.weight": np.zeros(7, np.float32)}.items(), ExportError,
         "shape"),
    ]
    poisoned = dict(params)
    w = np.asarray(poisoned["model.layers.1.self_attn.o_proj.weight"]).astype(np.float32)
    w[5, 5] = np.inf
    poisoned["model.layers.1.self_attn.o_proj.weight"] = w
    cases.append((poisoned.items(), QuantizationError, "o_proj.*NaN or Inf"))
    nan_norm = {**params, "model.norm.weight": np.full(128, np.nan, np.float32)}
    cases.append((nan_norm.items(), QuantizationError, "model.norm.weight.*NaN or Inf"))
    for tensors, exc, match in cases:
        with pytest.raises(exc, match=match):
            export_hf(iter(tensors), cfg, tmp_path / "out", "fp8_block", max_shard_bytes=32 * 1024)
        assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []
        # the background producer stopped with the export, not at some later garbage collection
        assert not [t for t in threading.enumerate() if t.name == "mixrl-export-prefetch"]


def test_export_drops_inv_freq_and_a_stored_tied_lm_head(tmp_path):
    tied = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                       tie_word_embeddings=True)
    params = make_params(tied)
    extra = {"lm_head.weight": params["model.embed_tokens.weight"],
             "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}
    out = export_hf(iter({**params, **extra}.items()), tied.to_hf_dict(), tmp_path / "t", "bf16")
    assert set(HFCheckpoint(out).names()) == set(params)


def test_export_refuses_quantized_configs_and_existing_outputs(tmp_path):
    params = make_params()
    cfg = MOE.to_hf_dict()
    with pytest.raises(ExportError, match="already has a quantization_config"):
        export_hf(iter(params.items()), {**cfg, "quantization_config": {"quant_method": "fp8"}},
                  tmp_path / "q", "nvfp4")
    out = export_hf(iter(params.items()), cfg, tmp_path / "x", "bf16")
    with pytest.raises(FileExistsError):
        export_hf(iter(params.items()), cfg, out, "bf16")
    export_hf(iter(params.items()), cfg, out, "mxfp4", overwrite=True)
    assert verify_dir(out).format == "mxfp4" and leftovers(tmp_path) == []


def test_kv_scales_and_input_amax_are_written(tmp_path):
    params = make_params()
    out = export_hf(iter(params.items()), MOE.to_hf_dict(), tmp_path / "nv", "nvfp4",
                    kv_scales={0: (0.5, 0.25), 1: (1.0, 2.0)},
                    input_amax={"model.layers.0.self_attn.q_proj": 26.88})
    verify_dir(out)
    ck = HFCheckpoint(out)
    k0, v0 = kv_scale_names(0)
    assert ck.get(k0) == np.float32(0.5) and ck.get(v0) == np.float32(0.25)
    assert ck.get("model.layers.0.self_attn.q_proj.input_scale") == np.float32(26.88) / 2688
    assert ck.get("model.layers.0.self_attn.k_proj.input_scale") == 1.0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_quant_algo"] == "FP8"


def test_publish_layout_latest_and_keep_last(tmp_path):
    params = make_params()
    root = tmp_path / "weights"
    formats = ["bf16", "fp8_block", "nvfp4", "mxfp4", "w8a8_int8"]
    for version in (3, 4, 5):
        paths = publish(lambda: iter(params.items()), MOE, root, version, formats, keep_last=2)
        assert set(paths) == set(formats)
        for fmt, path in paths.items():
            assert path == root / f"v{version:08d}" / fmt
            assert verify_dir(path).format == fmt
        meta = json.loads((root / f"v{version:08d}" / "version.json").read_text())
        assert meta["version"] == version and meta["formats"] == formats
        assert latest_version(root) == root / f"v{version:08d}"
    assert list_versions(root) == [4, 5]
    assert sorted(os.listdir(root)) == [LATEST, "v00000004", "v00000005"]
    with pytest.raises(FileExistsError):
        publish(params, MOE, root, 5, ["bf16"])


def test_publish_reads_a_one_shot_iterator_once_for_all_formats(tmp_path):
    params = make_params()
    reads = []

    def gen():
        for name, arr in params.items():
            reads.append(name)
            yield name, arr

    paths = publish(gen(), MOE, tmp_path, 0, ["fp8_block", "bf16", "nvfp4"], keep_last=None)
    assert len(reads) == len(params)  # one pass feeds every format
    bf16 = HFCheckpoint(paths["bf16"])
    for name, arr in params.items():
        assert np.array_equal(bf16.get(name), arr)


@pytest.mark.parametrize("where", ["source", "format"])
def test_failed_publish_leaves_no_version_and_keeps_latest(tmp_path, where):
    params = make_params()
    root = tmp_path / "w"
    publish(params, MOE, root, 1, ["bf16", "fp8_block"])

    def broken():
        for i, (name, arr) in enumerate(params.items()):
            if i == 10:
                if where == "source":
                    raise OSError("device lost")
                arr = np.full(arr.shape, np.nan, np.float32)
            yield name, arr

    with pytest.raises((OSError, QuantizationError)):
        publish(broken, MOE, root, 2, ["bf16", "fp8_block", "nvfp4"])
    assert list_versions(root) == [1] and latest_version(root) == root / "v00000001"
    assert leftovers(root) == []


def test_publish_validates_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown format"):
        publish(make_params(), MOE, tmp_path, 0, ["int4"])
    with pytest.raises(SourceError, match="config is required"):
        publish(make_params(), None, tmp_path, 0, ["bf16"])
    with pytest.raises(ValueError, match="version"):
        publish(make_params(), MOE, tmp_path, -1, ["bf16"])
    with pytest.raises(SourceError, match="not an HF directory"):
        publish(tmp_path, None, tmp_path / "x", 0, ["bf16"])


def test_orbax_round_trip_and_publish_from_checkpoint(tmp_path):
    params = make_params()
    ckpt = save_orbax(tmp_path / "ckpt", iter(params.items()), MOE)
    ob = OrbaxCheckpoint(ckpt)
    assert set(ob.names()) == set(params)
    restored = dict(ob.tensors())
    for name, arr in params.items():
        assert restored[name].dtype == arr.dtype and np.array_equal(restored[name], arr)
    paths = publish(ckpt, None, tmp_path / "pub", 7, ["bf16", "fp8_block"])
    bf16 = HFCheckpoint(paths["bf16"])
    assert all(np.array_equal(bf16.get(n), a) for n, a in params.items())
    assert Qwen3Config.from_hf_dict(bf16.config) == MOE


def test_hf_source_publish_copies_tokenizer_files(tmp_path):
    params = make_params()
    src = write_hf_checkpoint(tmp_path / "hf", iter(params.items()), MOE.to_hf_dict())
    (src / "tokenizer.json").write_text('{"fake": true}')
    paths = publish(src, None, tmp_path / "pub", 0, ["nvfp4"])
    assert (paths["nvfp4"] / "tokenizer.json").read_text() == '{"fake": true}'
    assert "tokenizer.json" in json.loads((paths["nvfp4"] / "manifest.json").read_text())["files"]


def _shards(path):
    return sorted(path.glob("model-*.safetensors"))


def test_verify_names_a_truncated_or_flipped_shard(tmp_path):
    params = make_params()
    out = export_hf(iter(params.items()), MOE.to_hf_dict(), tmp_path / "e", "fp8_block",
                    max_shard_bytes=64 * 1024)
    shard = _shards(out)[1]
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    with pytest.raises(VerifyError, match=shard.name) as e:
        verify_dir(out)
    assert any("truncated" in p for p in e.value.problems)
    with pytest.raises(VerifyError, match=shard.name):  # the header check catches it too
        verify_dir(out, manifest=False)
    flipped = bytearray(data)
    flipped[-5] ^= 0x40
    shard.write_bytes(bytes(flipped))
    with pytest.raises(VerifyError, match=f"{shard.name}.*sha256") as e:
        verify_dir(out)
    assert check_manifest(out, hashes=False) == []  # same size: only the hash catches it


def test_verify_names_missing_misshapen_and_unexpected_tensors(tmp_path):
    params = make_params()
    cfg = MOE.to_hf_dict()
    codec = get_codec("fp8_block")
    # A hand-made fp8 directory with one scale of the wrong shape and one tensor missing.
    tensors = []
    for name, arr in params.items():
        if name.endswith("mlp.up_proj.weight") or ".self_attn." in name and "proj" in name:
            parts = codec.quantize(arr)
            if name == "model.layers.0.self_attn.q_proj.weight":
                parts["weight_scale_inv"] = parts["weight_scale_inv"][:, :0]
            if name == "model.layers.1.self_attn.v_proj.weight":
                del parts["weight_scale_inv"]
            tensors += [(name[:-len("weight")] + s, p) for s, p in parts.items()]
        else:
            tensors.append((name, arr))
    tensors.append(("model.layers.0.self_attn.bogus", np.zeros(1, np.float32)))
    out = write_hf_checkpoint(tmp_path / "bad", tensors,
                              {**cfg, "quantization_config": codec.quantization_config([])})
    with pytest.raises(VerifyError) as e:
        verify_dir(out, manifest=False)
    text = "\n".join(e.value.problems)
    assert "q_proj.weight_scale_inv" in text and "model-00001-of-00001.safetensors" in text
    assert "v_proj.weight_scale_inv' is missing" in text
    assert "unexpected tensor 'model.layers.0.self_attn.bogus'" in text
    assert "mlp.gate_proj.weight" in text  # dense layer 0's gate_proj left bf16: wrong dtype
    with pytest.raises(VerifyError, match="manifest.json: missing"):
        verify_dir(out)


def test_verify_rejects_a_broken_config(tmp_path):
    out = export_hf(iter(make_params().items()), MOE.to_hf_dict(), tmp_path / "e", "bf16")
    (out / "config.json").write_text("{not json")
    with pytest.raises(VerifyError, match="config.json"):
        verify_dir(out, manifest=False)
