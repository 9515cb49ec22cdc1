"""Calibrated scales on every publish (issue 21 item 4): the trainer's JAX forward measures the
same maxima as an independent forward (transformers), the publisher writes the scales ModelOpt
would derive from them and records the calibration, and nothing changes when it is off."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiny_models import build_hf_model  # noqa: E402

from convert.calibration import Calibration, kv_scale  # noqa: E402
from convert.export import export_hf, kv_scale_names  # noqa: E402
from convert.hf_checkpoint import HFCheckpoint  # noqa: E402
from convert.manifest import read_manifest  # noqa: E402
from convert.qwen3_config import Qwen3Config  # noqa: E402
from trainer_jax.calibration import (  # noqa: E402
    Calibrator,
    fp8_kv_formats,
    group_kv_pairs,
    pack_calibration_ids,
)
from trainer_jax.models import load_hf  # noqa: E402
from trainer_jax.publisher import Publisher, snapshot  # noqa: E402

ROWS, T = 2, 12
NVFP4_DIV = np.float32(6 * 448)


def _reference_maxima(model, ids: np.ndarray) -> tuple[dict[str, float], dict[int, tuple]]:
    """Max |input| of every projection and max |K|, |V| of every layer, from transformers'
    forward over the rows of ``ids`` (hooks on the linears, the fused experts' routing redone
    per expert, K/V as its cache holds them)."""
    inputs: dict[str, float] = {}
    hooks = []

    def keep(name, value):
        inputs[name] = max(inputs.get(name, 0.0), float(value))

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name and not name.endswith("mlp.gate"):
            hooks.append(module.register_forward_pre_hook(
                lambda m, args, name=name: keep(name, args[0].abs().max())))
        if type(module).__name__ == "Qwen3MoeExperts":
            def experts(m, args, name=name):
                x, top_k, _ = args
                for e in range(m.num_experts):
                    rows = (top_k == e).any(-1)
                    if not rows.any():
                        continue
                    xs = x[rows]
                    gate, up = torch.nn.functional.linear(xs, m.gate_up_proj[e]).chunk(2, dim=-1)
                    for proj, value in (("gate_proj", xs), ("up_proj", xs),
                                        ("down_proj", m.act_fn(gate) * up)):
                        keep(f"{name}.{e}.{proj}", value.abs().max())
            hooks.append(module.register_forward_pre_hook(experts))
    with torch.no_grad():
        cache = model(torch.as_tensor(ids), use_cache=True).past_key_values
    for h in hooks:
        h.remove()
    kv = {i: (float(layer.keys.abs().max()), float(layer.values.abs().max()))
          for i, layer in enumerate(cache.layers)}
    return inputs, kv


@pytest.fixture(scope="module", params=["dense_untied_gqa4", "moe_norm_topk"])
def case(request, tmp_path_factory):
    hf = build_hf_model(request.param, seed=3)
    path = tmp_path_factory.mktemp("calib") / "hf"
    hf.save_pretrained(path)  # float32
    ids = np.random.default_rng(1).integers(0, hf.config.vocab_size, (ROWS, T))
    model, cfg = load_hf(path)
    return dict(path=path, ids=ids, model=model, cfg=cfg, reference=_reference_maxima(hf, ids))


def _calibrator(case, kv_floor: float = 0.0) -> Calibrator:
    """amax / 448 as is (``kv_floor`` 0), so the K/V scales show the measured maxima."""
    cal = Calibrator(case["model"], tokens=ROWS * T, kv_floor=kv_floor)
    cal.observe(case["ids"])  # the two rows, each its own segment of the packed row
    return cal


def test_maxima_equal_an_independent_reference_forward(case):
    result = _calibrator(case)(version=5)
    ref_inputs, ref_kv = case["reference"]
    assert (result.tokens, result.sequences, result.source_version, result.data) == (
        ROWS * T, ROWS, 5, "trajectories")
    for module, amax in ref_inputs.items():
        assert result.input_amax[module] == pytest.approx(amax, rel=2e-5), module
    unrouted = set(result.input_amax) - set(ref_inputs)  # experts no token reached
    for module in unrouted:
        layer = module.split(".mlp.")[0]
        proj = module.rsplit(".", 1)[1]
        largest = max(v for m, v in ref_inputs.items() if m.startswith(layer + ".mlp.experts.")
                      and m.endswith(proj if proj == "down_proj" else "up_proj"))
        assert result.input_amax[module] == pytest.approx(largest, rel=2e-5), module
    assert sorted(result.kv_amax) == sorted(ref_kv)
    for layer, (k, v) in ref_kv.items():
        assert result.kv_amax[layer] == pytest.approx((k, v), rel=2e-5)


def _files(path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def test_a_publish_through_the_loop_path_writes_the_scales(case, tmp_path):
    """``Publisher.request`` (what the training loop calls): nvfp4 input scales, K/V scales in
    the format a group runs with an fp8 KV cache, the calibration in those manifests only."""
    cal = _calibrator(case)
    pub = Publisher(tmp_path / "w", case["cfg"].to_hf_dict(),
                    lambda: ["bf16", "nvfp4", "fp8_block"], None, 3, lambda v, p: None,
                    engines=lambda: "mixrl", calibrator=cal,
                    kv_cache_formats=lambda: ["nvfp4"])
    try:
        pub.request(7, snapshot(case["model"]))
    finally:
        pub.close()
    assert pub.errors == [] and pub.published == [7]
    root = tmp_path / "w" / "v00000007"
    ref_inputs, ref_kv = case["reference"]
    ck = HFCheckpoint(root / "nvfp4")
    calibration = cal.history[-1]
    for module, amax in calibration.input_amax.items():
        scale = ck.get(f"{module}.input_scale")
        assert scale == np.float32(amax) / NVFP4_DIV, module  # ModelOpt's amax / (6 * 448)
        if module in ref_inputs:
            assert float(scale) == pytest.approx(ref_inputs[module] / 2688, rel=2e-5)
    for layer, (k, v) in ref_kv.items():
        k_name, v_name = kv_scale_names(layer)
        assert float(ck.get(k_name)) == pytest.approx(k / 448, rel=2e-5)
        assert float(ck.get(v_name)) == pytest.approx(v / 448, rel=2e-5)
    record = read_manifest(root / "nvfp4")["calibration"]
    assert record["tokens"] == ROWS * T and record["source_version"] == 7
    assert record["method"] == "max" and record["data"] == "trajectories"
    assert len(record["sets"]) == 2
    assert json.loads((root / "nvfp4" / "config.json").read_text())["quantization_config"][
        "kv_cache_quant_algo"] == "FP8"
    for fmt in ("bf16", "fp8_block"):  # nothing calibrated in these: as before
        assert "calibration" not in read_manifest(root / fmt)
        assert not any(n.endswith("k_scale") for n in HFCheckpoint(root / fmt).names())


def test_disabled_is_byte_identical_to_an_export_without_calibration(case, tmp_path):
    tensors = snapshot(case["model"])
    hf_config = case["cfg"].to_hf_dict()
    pub = Publisher(tmp_path / "w", hf_config, lambda: ["nvfp4", "fp8_block"], None, 3,
                    lambda v, p: None, engines=lambda: "mixrl", calibrator=None,
                    kv_cache_formats=lambda: ["nvfp4"])
    try:
        pub.publish_now(1, tensors)
    finally:
        pub.close()
    for fmt in ("nvfp4", "fp8_block"):
        plain = export_hf(iter(tensors.items()), hf_config, tmp_path / f"plain-{fmt}", fmt,
                          metadata={"version": 1}, engines="mixrl")
        published = tmp_path / "w" / "v00000001" / fmt
        got, want = _files(published), _files(plain)
        assert got.keys() == want.keys()
        for name in want:
            if name == "manifest.json":  # identical but for the time it was written
                a, b = json.loads(got[name]), json.loads(want[name])
                a.pop("created_unix"), b.pop("created_unix")
                assert a == b
            else:
                assert got[name] == want[name], (fmt, name)
    ck = HFCheckpoint(tmp_path / "w" / "v00000001" / "nvfp4")
    scales = {n for n in ck.names() if n.endswith("input_scale")}
    assert scales and all(ck.get(n) == np.float32(1.0) for n in scales)


def test_no_forward_when_no_format_needs_a_scale(case, tmp_path):
    cal = _calibrator(case)
    pub = Publisher(tmp_path / "w", case["cfg"].to_hf_dict(), lambda: ["bf16", "fp8_block"], None,
                    3, lambda v, p: None, engines=lambda: "mixrl", calibrator=cal)
    try:
        pub.publish_now(0, snapshot(case["model"]))
    finally:
        pub.close()
    assert cal.history == []


def test_packing_fills_exactly_with_one_segment_per_sequence():
    ids, segs, used = pack_calibration_ids([[1, 2, 3], [4, 5]], 8)
    assert ids.tolist() == [[1, 2, 3, 4, 5, 1, 2, 3]]
    assert segs.tolist() == [[1, 1, 1, 2, 2, 3, 3, 3]] and used == 2
    ids, segs, used = pack_calibration_ids([np.arange(10)], 4)
    assert ids.tolist() == [[0, 1, 2, 3]] and used == 1
    with pytest.raises(ValueError, match="no token ids"):
        pack_calibration_ids([[]], 4)


def test_kv_formats_and_scale_rule():
    from trainer_jax.config import RunConfig

    cfg = RunConfig.model_validate({"groups": [
        {"name": "a", "recipe": "nvfp4_w4a4"},
        {"name": "b", "recipe": "bf16", "kv_cache_dtype": "fp8_e4m3"},
        {"name": "c", "recipe": "fp8", "kv_cache_dtype": "fp8_e5m2"}]})
    registered = [{"recipe": {"weight_format": "w8a8_int8", "kv_dtype": "float8_e4m3fn"}}]
    assert fp8_kv_formats(group_kv_pairs(cfg.groups, registered)) == ["bf16", "w8a8_int8"]
    weights = cfg.train.weights
    assert weights.calibrate and weights.calibration_tokens == 256 and weights.kv_scale_floor == 1.0
    with pytest.raises(ValueError, match="calibration_tokens"):
        RunConfig.model_validate({"train": {"weights": {"calibration_tokens": 4}}})
    assert kv_scale(448.0) == 1.0 and kv_scale(0.0) == 1e-6 and kv_scale(44.8, floor=1.0) == 1.0
    with pytest.raises(ValueError, match="input amax"):
        Calibration(input_amax={"m": float("nan")}, kv_amax={}, tokens=1, sequences=1,
                    source_version=0)


def test_engine_uses_the_calibrated_scales(case, tmp_path):
    """The mixrl engine's W4A4 linears and FP8 KV cache take the published scales."""
    from sampler_torch.recipes import get_recipe
    from sampler_torch.recipes.linear import NVFP4Linear
    from sampler_torch.recipes.loader import load_model

    cal = _calibrator(case, kv_floor=1.0)  # the default: ModelOpt's floor
    pub = Publisher(tmp_path / "w", case["cfg"].to_hf_dict(), lambda: ["nvfp4"], None, 3,
                    lambda v, p: None, engines=lambda: "mixrl", calibrator=cal,
                    kv_cache_formats=lambda: ["nvfp4"])
    try:
        paths = pub.publish_now(2, snapshot(case["model"]))
    finally:
        pub.close()
    loaded = load_model(paths["nvfp4"], get_recipe("nvfp4_w4a4", kv_cache_dtype="fp8_e4m3"))
    calibration = cal.history[-1]
    linears = {n: m for n, m in loaded.model.named_modules() if isinstance(m, NVFP4Linear)}
    assert linears
    for name, module in linears.items():
        assert float(module.input_scale) == np.float32(calibration.input_amax[name]) / NVFP4_DIV
    assert calibration.kv_scales() == {i: (max(k / 448, 1.0), max(v / 448, 1.0))
                                       for i, (k, v) in calibration.kv_amax.items()}
    assert loaded.k_scales == [np.float32(k) for k, _ in calibration.kv_scales().values()]
    assert loaded.v_scales == [np.float32(v) for _, v in calibration.kv_scales().values()]


def test_capture_points_record_only_while_recording():
    import jax

    from trainer_jax.models import init_model
    from trainer_jax.models.capture import recording

    cfg = Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    model = init_model(cfg)
    with recording() as record:
        pass
    jax.make_jaxpr(lambda ids: model(ids))(np.zeros((1, 4), np.int32))  # outside: nothing kept
    assert record == []
    with recording() as record:
        jax.make_jaxpr(lambda ids: model(ids))(np.zeros((1, 4), np.int32))
    assert [n for n, _ in record] == ["self_attn.qkv", "self_attn.k", "self_attn.v", "self_attn.o",
                                      "mlp.gate_up", "mlp.down"]


def test_calibrating_a_remat_model_gives_the_same_maxima():
    """The training config's remat does not reach the calibration forward (records cannot cross
    a remat trace); the maxima are those of the plain model."""
    from trainer_jax.models import init_model

    cfg = Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    ids = [np.arange(9) % 32, np.arange(5, 12)]
    results = []
    for remat in ("none", "full"):
        cal = Calibrator(init_model(cfg, seed=4, remat=remat), tokens=16)
        cal.observe(ids)
        results.append(cal(version=1))
    assert results[0].input_amax == results[1].input_amax
    assert results[0].kv_amax == results[1].kv_amax
