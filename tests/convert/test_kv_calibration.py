"""FP8 KV-cache scales calibrated with the sampler model, checked against transformers' cache."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiny_models import build_hf_model  # noqa: E402

from convert.cli import main  # noqa: E402
from convert.export import kv_scale_names  # noqa: E402
from convert.hf_checkpoint import HFCheckpoint  # noqa: E402
from convert.verify import verify_dir  # noqa: E402
from sampler_torch.kv_calibration import calibrate_kv_scales  # noqa: E402


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv") / "hf"
    build_hf_model("moe_norm_topk").save_pretrained(path)  # float32
    return path


def test_scales_are_cached_k_v_amax_over_448(hf_dir):
    ids = np.random.default_rng(0).integers(0, 97, (3, 11))
    scales = calibrate_kv_scales(hf_dir, ids)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        cache = model(torch.as_tensor(ids), use_cache=True).past_key_values
    assert sorted(scales) == list(range(model.config.num_hidden_layers))
    for i, layer in enumerate(cache.layers):  # what transformers caches: K after norm + RoPE
        k_ref = float(layer.keys.abs().max()) / 448
        v_ref = float(layer.values.abs().max()) / 448
        assert scales[i] == pytest.approx((k_ref, v_ref), rel=1e-5)
    with pytest.raises(ValueError, match="token ids"):
        calibrate_kv_scales(hf_dir, np.array([[0, 97]]))


def test_quantize_with_kv_calibration_writes_scales(hf_dir, tmp_path):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([[1, 2, 3, 4], [5, 6, 7, 8]]))
    out = tmp_path / "nvfp4"
    assert main(["quantize", "--in", str(hf_dir), "--format", "nvfp4", "--out", str(out),
                 "--kv-calibration", str(ids), "--quiet"]) == 0
    verify_dir(out)
    ck = HFCheckpoint(out)
    expect = calibrate_kv_scales(hf_dir, json.loads(ids.read_text()))
    for layer, (k, v) in expect.items():
        k_name, v_name = kv_scale_names(layer)
        assert ck.get(k_name) == np.float32(k) and ck.get(v_name) == np.float32(v)
    assert json.loads((out / "hf_quant_config.json").read_text())["quantization"][
        "kv_cache_quant_algo"] == "FP8"
