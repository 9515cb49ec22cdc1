"""Samplers on their device: ``--device`` specs and ``auto`` resolution (pure functions), the
``--device cuda`` refusal of a real ``mixrl-sample`` on this CUDA-less machine, per-device kernel
probes, attention ``auto`` and compile ``auto`` per device, the CUDA-shape padding of the native
int8 / fp8 kernels (checked on the CPU, where the same kernels run unpadded), and a live CUDA run
that must match the CPU (skipped without a GPU)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from convert.formats import get_codec
from mixrl_wire.devices import DeviceError, check_spec, local_rank, resolve_device, spawn_slot, spawned_env
from sampler_torch.device import describe, local_device
from sampler_torch.engine import Engine, SamplingParams
from sampler_torch.recipes import get_recipe, load_model, resolve_attention
from sampler_torch.recipes import linear as linear_mod
from sampler_torch.recipes.linear import (
    FP8BlockLinear,
    Int8Linear,
    matmul_kernel,
    native_kernel_available,
    recipe_kernels,
)

REPO = Path(__file__).resolve().parents[2]

# ------------------------------------------------------------------------- specs and auto


@pytest.mark.parametrize("spec", ["auto", "cpu", "cuda", "cuda:0", "cuda:3"])
def test_good_specs(spec):
    assert check_spec(spec) == spec


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "cuda:-1", "cpu:0", "auto:1", "CUDA", "", "cuda:x"])
def test_bad_specs(spec):
    with pytest.raises(DeviceError, match="expected auto, cpu, cuda or cuda:N"):
        check_spec(spec)


@pytest.mark.parametrize("spec, visible, rank, want", [
    ("auto", 0, None, "cpu"),          # no GPU: auto is the CPU
    ("auto", 0, 3, "cpu"),
    ("auto", 1, None, "cuda:0"),
    ("auto", 4, None, "cuda:0"),       # no launcher: the first visible device
    ("auto", 4, 2, "cuda:2"),          # torchrun / SLURM: the LOCAL_RANK-th visible device
    ("auto", 1, 5, "cuda:0"),          # Ray / SLURM bound one GPU per process: that one
    ("cuda", 4, 1, "cuda:1"),          # cuda without index = the local GPU, as auto
    ("cuda:3", 4, 0, "cuda:3"),        # an explicit index wins over the rank
    ("cpu", 8, 2, "cpu"),
])
def test_resolve_device(spec, visible, rank, want):
    assert resolve_device(spec, visible=visible, rank=rank) == want


@pytest.mark.parametrize("spec, visible, rank, match", [
    ("cuda", 0, None, "sees no CUDA device"),
    ("cuda:0", 0, None, "sees no CUDA device"),
    ("cuda:2", 2, None, "only 2 CUDA device"),
    ("auto", 2, 3, "local rank 3 but only 2"),
])
def test_resolve_device_refuses(spec, visible, rank, match):
    with pytest.raises(DeviceError, match=match):
        resolve_device(spec, visible=visible, rank=rank, cuda_visible_devices="4,5")


def test_resolve_device_names_cuda_visible_devices():
    with pytest.raises(DeviceError, match=r"CUDA_VISIBLE_DEVICES='6'"):
        resolve_device("cuda:1", visible=1, cuda_visible_devices="6")


def test_spawned_samplers_spread_over_the_visible_gpus():
    """A trainer's spawned samplers get a slot instead of the trainer's launcher rank: auto takes
    GPU slot % visible (eight samplers on four GPUs: two each), never all on the trainer's GPU."""
    trainer_env = {"LOCAL_RANK": "0", "SLURM_LOCALID": "0", "PATH": "/bin"}
    envs = [spawned_env(trainer_env, slot) for slot in range(8)]
    assert all("LOCAL_RANK" not in e and "SLURM_LOCALID" not in e and e["PATH"] == "/bin" for e in envs)
    devices = [resolve_device("auto", visible=4, rank=local_rank(e), slot=spawn_slot(e)) for e in envs]
    assert devices == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"] * 2
    assert resolve_device("auto", visible=0, slot=5) == "cpu"
    assert resolve_device("cuda:1", visible=4, slot=3) == "cuda:1"  # an explicit index wins
    with pytest.raises(DeviceError, match="MIXRL_SAMPLER_SLOT"):
        spawn_slot({"MIXRL_SAMPLER_SLOT": "x"})


def test_local_rank_from_launchers():
    assert local_rank({}) is None
    assert local_rank({"LOCAL_RANK": "3", "SLURM_LOCALID": "1"}) == 3  # torchrun first
    assert local_rank({"SLURM_LOCALID": "1"}) == 1
    with pytest.raises(DeviceError, match="LOCAL_RANK='x'"):
        local_rank({"LOCAL_RANK": "x"})


def test_local_device_here():
    want = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert local_device("auto", {}) == want
    assert local_device("cpu", {"LOCAL_RANK": "7"}) == "cpu"
    assert describe("cpu")["type"] == "cpu"


# ------------------------------------------------------------------------- mixrl-sample


def _sample(*args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k != "MIXRL_TOKEN"} | (env_extra or {})
    return subprocess.run([sys.executable, "-m", "sampler_torch.cli", "--trainer", "127.0.0.1:1",
                           "--group", "g", "--model-dir", "/nonexistent/model", *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=env)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_device_cuda_refused_before_the_token_check():
    out = _sample("--device", "cuda")  # no token, no model: the device is the one complaint
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "--device cuda" in lines[0] and "no CUDA device" in lines[0]
    assert "token" not in lines[0]


def test_bad_device_spec_is_one_line():
    out = _sample("--device", "tpu")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "mixrl-sample: device 'tpu': expected auto, cpu, cuda or cuda:N"]


def test_device_cpu_goes_on_to_the_token_check():
    out = _sample("--device", "cpu")
    assert out.returncode == 2
    assert "no bearer token" in out.stderr.strip().splitlines()[-1]


# ------------------------------------------------------------------------- kernels per device


def test_probes_run_once_per_device_and_kind(monkeypatch):
    calls = []
    real_scaled, real_int = linear_mod._has_scaled_mm, linear_mod._has_int_mm

    def spy(real, kind):
        def probe(device):
            calls.append((kind, str(device)))
            return real(device)
        return probe

    monkeypatch.setattr(linear_mod, "_PROBES", {})
    monkeypatch.setattr(linear_mod, "_has_scaled_mm", spy(real_scaled, "fp8"))
    monkeypatch.setattr(linear_mod, "_has_int_mm", spy(real_int, "int8"))
    for _ in range(3):
        for kind in ("fp8", "int8"):
            native_kernel_available(kind, "cpu")
            native_kernel_available(kind, torch.device("cpu"))
            native_kernel_available(kind, "meta")  # a second device: its own probe and entry
    assert sorted(calls) == sorted([("fp8", "cpu"), ("int8", "cpu"), ("fp8", "meta"),
                                    ("int8", "meta")])
    assert set(linear_mod._PROBES) == {("fp8", "cpu"), ("int8", "cpu"), ("fp8", "meta"),
                                       ("int8", "meta")}
    with pytest.raises(ValueError, match="no native kernel kind"):
        native_kernel_available("fp4", "cpu")


def test_matmul_kernel_per_recipe_follows_the_probe():
    kernels = recipe_kernels("cpu")
    assert kernels["bf16"] == "native"
    assert kernels["nvfp4_w4a4"] == kernels["nvfp4_w4a16"] == kernels["mxfp4_w4a16"] == "emulate"
    # auto: fp8 emulated on the CPU (torch's CPU _scaled_mm is slower than the emulation)
    assert kernels["fp8"] == "emulate"
    assert kernels["int8"] == ("native" if native_kernel_available("int8", "cpu") else "emulate")
    assert matmul_kernel(get_recipe("int8", kernel="emulate"), "cpu") == "emulate"
    fp8_native = get_recipe("fp8", kernel="native")
    assert matmul_kernel(fp8_native, "cpu") == (
        "native" if native_kernel_available("fp8", "cpu") else "unavailable")
    assert matmul_kernel(fp8_native, "meta") in ("native", "unavailable")


@pytest.mark.skipif(not native_kernel_available("int8", "cpu"), reason="no torch._int_mm here")
@pytest.mark.parametrize("rows", [1, 5, 17, 40])
def test_int8_cuda_padding_changes_nothing(rows):
    rng = np.random.default_rng(rows)
    parts = get_codec("w8a8_int8").quantize(rng.standard_normal((50, 44)).astype(np.float32))
    x = torch.from_numpy(rng.standard_normal((rows, 44)).astype(np.float32))
    padded = Int8Linear(parts, native=True, pad=True)
    assert tuple(padded.weight.shape) == (56, 48)  # multiples of 8, as CUDA's _int_mm needs
    assert torch.equal(padded(x), Int8Linear(parts, native=True)(x))
    assert torch.equal(padded(x), Int8Linear(parts, native=False)(x))


@pytest.mark.skipif(not native_kernel_available("fp8", "cpu"), reason="no torch._scaled_mm here")
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_fp8_cuda_padding_changes_nothing(rows):
    rng = np.random.default_rng(rows)
    parts = get_codec("fp8_block").quantize(rng.standard_normal((200, 300)).astype(np.float32))
    x = torch.from_numpy(rng.standard_normal((rows, 300)).astype(np.float32))
    padded = FP8BlockLinear(parts, native=True, pad=True)
    assert [tuple(getattr(padded, f"weight_g{g}").shape) for g in range(3)] == [
        (208, 128), (208, 128), (208, 48)]  # multiples of 16, as CUDA's _scaled_mm needs
    # Equal up to float32 summation order (the padded GEMM blocks differently).
    np.testing.assert_allclose(padded(x).numpy(), FP8BlockLinear(parts, native=True)(x).numpy(),
                               rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------- attention, compile


def test_attention_auto_resolves_per_device():
    assert resolve_attention("auto", "cpu") == "eager"
    assert resolve_attention("auto", "cuda") == "sdpa"
    for impl in ("sdpa", "eager"):  # explicit choices mean what they say everywhere
        assert resolve_attention(impl, "cpu") == resolve_attention(impl, "cuda") == impl
    assert get_recipe("bf16").attention == "auto"


def test_engine_defaults_on_the_cpu(hf_model_dir):
    path, _ = hf_model_dir("dense_untied_gqa4")
    engine = Engine(path, "bf16", max_batch=2)
    assert (engine.device.type, engine.attention, engine.compile, engine.matmul_kernel) == (
        "cpu", "eager", False, "native")
    assert Engine(path, "bf16", attention="sdpa", compile=True).attention == "sdpa"
    assert {m.impl for m in load_model(path, get_recipe("bf16")).model.modules()
            if hasattr(m, "impl")} == {"eager"}
    with pytest.raises(ValueError, match="compile must be"):
        Engine(path, "bf16", compile="yes")


# ------------------------------------------------------------------------- live CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_engine_on_cuda_matches_the_cpu(hf_model_dir):
    """fp32 mode, same seeds: the GPU's completions equal the CPU's up to float rounding (the
    tokens while the distributions agree, log-probs to 1e-3)."""
    path, _ = hf_model_dir("dense_untied_gqa4")
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    params = SamplingParams(temperature=1.0, top_p=0.9, head_k=5, max_new_tokens=12, seed=3)
    cpu = Engine(path, "bf16", compute_dtype="float32", max_batch=4).generate(prompts, params)
    for compile in (False, True):
        gpu_engine = Engine(path, "bf16", compute_dtype="float32", max_batch=4, device="cuda",
                            compile=compile)
        assert gpu_engine.model.lm_head.weight.device.type == "cuda"
        gpu = gpu_engine.generate(prompts, params)
        for a, b in zip(cpu, gpu, strict=True):
            n = next((t for t in range(12) if a.token_ids[t] != b.token_ids[t]), 12)
            assert n >= 6, (a.token_ids, b.token_ids)
            np.testing.assert_allclose(a.logprobs[:n], b.logprobs[:n], atol=1e-3)
            np.testing.assert_allclose(a.head_logprobs[:n], b.head_logprobs[:n], atol=1e-3)
    for name, kernel in recipe_kernels("cuda").items():
        assert kernel in ("native", "emulate"), name
