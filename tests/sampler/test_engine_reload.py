"""In-flight weight reloads: the version changes at a step boundary, a step never mixes the
tensors of two versions, and a bad export is refused while generation carries on. Reloads write
into the served tensors (``sampler_torch.engine.reload``): no second model is built."""

import shutil
import threading

import numpy as np
import pytest
import torch
from tiny_models import build_hf_model

from convert.export import export_hf
from convert.hf_checkpoint import HFCheckpoint
from sampler_torch.engine import Engine, SamplingParams
from sampler_torch.recipes import RecipeError, WeightLoadError

NAME = "dense_untied_gqa4"


def _export(src, out, fmt="bf16"):
    ckpt = HFCheckpoint(src)
    return export_hf(ckpt.tensors(), ckpt.config, out, fmt, engines="mixrl")


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Two versions of the same architecture (different random weights), as bf16 exports."""
    root = tmp_path_factory.mktemp("versions")
    dirs = {}
    for version, seed in ((0, 0), (1, 1)):
        build_hf_model(NAME, seed=seed).save_pretrained(root / f"src{version}")
        dirs[version] = _export(root / f"src{version}", root / f"v{version}")
    dirs["fp8"] = _export(root / "src1", root / "v1_fp8", "fp8_block")
    build_hf_model("dense_tied_gqa2").save_pretrained(root / "other_src")
    dirs["other"] = _export(root / "other_src", root / "other")
    return dirs


def _weights(engine) -> dict[int, float]:
    """Every matmul weight the engine's forward reads, by address, with a checksum of its values."""
    return {t.data_ptr(): float(t.double().sum()) for t in engine.forward.tensors()}


def test_reload_switches_version_at_a_step_and_never_mixes_within_one(exports, monkeypatch):
    eng = Engine(exports[0], "bf16", compute_dtype="float32", max_batch=2, version=0)
    model_a, a = eng.model, _weights(eng)
    steps: list[list[tuple[int, float]]] = [[]]
    linear = torch.nn.functional.linear

    def recording_linear(x, weight, *args, **kwargs):
        # Every matmul weight the engine touches (fused projections and lm_head included), and
        # the values it holds at that moment.
        steps[-1].append((weight.data_ptr(), float(weight.double().sum())))
        return linear(x, weight, *args, **kwargs)

    def on_step(step):
        if step == 3:
            eng.load_weights(exports[1], 1)
        steps.append([])

    monkeypatch.setattr(torch.nn.functional, "linear", recording_linear)
    outs = eng.generate([[1, 2, 3], [4, 5], [6, 7]],
                        SamplingParams(max_new_tokens=8, top_p=0.9, seed=0), on_step=on_step)
    monkeypatch.undo()
    # In place: the same model and tensors, holding version 1's values from step 4 on.
    assert eng.model is model_a and eng.version == 1
    assert eng.last_stats.swaps == [(4, 1)] and len(eng.last_stats.pauses_s) == 1
    b = _weights(eng)
    assert set(a) == set(b) and all(a[p] != b[p] for p in a)
    for step, used in enumerate(steps[:-1]):
        assert used, f"step {step} ran no forward"
        want = a if step <= 3 else b
        assert all(want[p] == v for p, v in used), f"step {step} used values of the wrong version"
    # Requests running through the swap: tokens of steps 0-3 from version 0, the rest from 1.
    assert outs[0].versions == outs[1].versions == [0] * 4 + [1] * 4
    # Request 2 was admitted after the swap: every token, KV cache included, is version 1,
    # so its records equal the new weights' teacher-forced distribution.
    assert outs[2].versions == [1] * 8
    fresh = Engine(exports[1], "bf16", compute_dtype="float32")
    logits = fresh.logits([[6, 7] + outs[2].token_ids])[0][1:-1]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(outs[2].token_ids)[:, None])
    np.testing.assert_allclose(outs[2].logprobs_full, expected[:, 0].numpy(), atol=1e-5)
    assert eng.weights_digest() == fresh.weights_digest()


def test_reload_from_another_thread_lands_between_steps(exports):
    eng = Engine(exports[0], "bf16", max_batch=4, version=0)
    loader: list[threading.Thread] = []

    def on_step(step):
        if step == 1:
            loader.append(threading.Thread(target=eng.load_weights, args=(exports[1], 1)))
            loader[0].start()
        if step == 5:
            loader[0].join()  # the swap then happens before step 6's forwards

    outs = eng.generate([[1, 2]] * 4, SamplingParams(max_new_tokens=12, seed=3), on_step=on_step)
    for c in outs:
        switch = c.versions.index(1)
        assert 2 <= switch <= 6 and c.versions == [0] * switch + [1] * (12 - switch)
    assert len({c.versions.index(1) for c in outs}) == 1  # all rows switch at the same step


def _corrupt(src, dst, how):
    shutil.copytree(src, dst)
    shard = sorted(dst.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    if how == "flip":
        data[-7] ^= 0x40
        shard.write_bytes(bytes(data))
    elif how == "truncate":
        shard.write_bytes(bytes(data[:-64]))
    elif how == "no_manifest":
        (dst / "manifest.json").unlink()
    return dst


@pytest.mark.parametrize("how,match", [("flip", "sha256"), ("truncate", "size"),
                                       ("no_manifest", "manifest")])
def test_corrupt_export_is_refused_and_generation_continues(exports, tmp_path, how, match):
    bad = _corrupt(exports[1], tmp_path / "bad", how)
    params = SamplingParams(max_new_tokens=6, seed=9)
    eng = Engine(exports[0], "bf16", compute_dtype="float32", max_batch=2, version=0)
    baseline = eng.generate([[1, 2], [3]], params)
    errors = []

    def on_step(step):
        if step == 2:
            with pytest.raises(WeightLoadError, match=match) as e:
                eng.load_weights(bad, 1)
            errors.append(e.value)

    outs = eng.generate([[1, 2], [3]], params, on_step=on_step)
    assert errors and eng.version == 0 and eng.last_stats.swaps == []
    for c, ref in zip(outs, baseline, strict=True):
        assert c.token_ids == ref.token_ids and c.versions == [0] * 6
        np.testing.assert_allclose(c.logprobs, ref.logprobs, atol=0)


def test_mismatched_exports_are_refused(exports):
    eng = Engine(exports[0], "bf16", version=0)
    with pytest.raises(RecipeError, match="fp8_block"):
        eng.load_weights(exports["fp8"], 1)
    with pytest.raises(WeightLoadError, match="architecture"):
        eng.load_weights(exports["other"], 1)
    assert eng.version == 0
    eng.load_weights(exports[1], 1)  # idle: applied at once
    assert eng.version == 1 and eng.model_dir == exports[1]
