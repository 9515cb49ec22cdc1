"""The vLLM backend against a local HTTP server (a real socket) that answers in vLLM's
``/v1/completions`` format (token ids in, ``return_tokens_as_token_ids`` logprobs, Mask Replay's
``sampling_mask``) and its RLHF routes (``/pause``, ``/resume``, ``/update_weights``), plus a live
test for GPU hosts.

The fake server's "model" is a fixed table of next-token logits per weights version, indexed by
the previous token, so the test knows every distribution exactly and checks the backend's
conversion (vLLM's raw or processed logprobs + the kept set -> the behaviour record)."""

import json
import math
import threading
import time

import numpy as np
import pytest
from fake_http import JSONServer, good_and_corrupt_exports

from sampler_torch.backends import VLLMBackend, VLLMError, vllm_available, vllm_server_args
from sampler_torch.backends.vllm import rebuilt_support, sampling_mask_rows
from sampler_torch.engine import SamplingParams
from sampler_torch.recipes import RecipeError, WeightLoadError, get_recipe

VOCAB = 40
MODEL = "served-qwen"


def _table(version: int) -> np.ndarray:
    return np.random.default_rng(version + 200).normal(size=(VOCAB, VOCAB)) * 2


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
    """A toy server speaking vLLM's OpenAI-compatible completions API and RLHF routes."""

    def __init__(self, *, logprobs_mode="raw_logprobs", mask="csr", delay=0.0):
        self.logprobs_mode, self.mask, self.delay = logprobs_mode, mask, delay
        super().__init__()
        self.version = 0
        self.paused = False
        self.events: list[str] = []

    def route(self, method, path, body, query):
        if method == "GET":
            if path == "/health":
                return 200, {}
            if path == "/v1/models":
                return 200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
            return 404, {"detail": "Not Found"}
        handler = {"/v1/completions": self.completions, "/pause": self.pause,
                   "/resume": self.resume, "/update_weights": self.update,
                   "/init_weight_transfer_engine": self.init}.get(path)
        return handler(body, query) if handler else (404, {"detail": "Not Found"})

    def init(self, body, query):
        return 200, {"message": "Weight transfer initialized"}

    def pause(self, body, query):
        assert query == "mode=wait"
        self.paused = True
        self.events.append("pause")
        return 200, {"status": "paused"}

    def resume(self, body, query):
        self.paused = False
        self.events.append("resume")
        return 200, {"status": "resumed"}

    def update(self, body, query):
        path = body["update_info"]["path"]
        if "bad" in path:
            return 500, {"error": f"Shared-disk checkpoint path must be a local directory: {path}"}
        self.version += 1
        self.events.append(f"update {path}")
        return 200, {"message": "Weights updated"}

    def completions(self, body, query):
        assert body["model"] == MODEL and body["return_tokens_as_token_ids"] is True
        assert not self.paused, "a request reached the server during a reload"
        self.events.append("completion")
        time.sleep(self.delay)
        rng = np.random.default_rng(body["seed"])
        temp, top_p, top_k = body["temperature"], body["top_p"], body["top_k"]
        seq, ids, lps, tops, rows = list(body["prompt"]), [], [], [], []
        finish = "length"
        for _ in range(body["max_tokens"]):
            z = _table(self.version)[seq[-1] % VOCAB]  # prompts may hold larger ids
            raw = _log_softmax(z)
            if temp == 0:
                kept = np.array([int(np.argmax(raw))])
                logq = raw
            else:
                logq = _log_softmax(z / temp)
                kept = _kept(logq, top_p, top_k)
            b = np.exp(logq[kept]) / np.exp(logq[kept]).sum()
            x = int(rng.choice(kept, p=b))
            if self.logprobs_mode == "raw_logprobs":
                shown = raw
            else:  # processed: after temperature and truncation
                shown = np.full(VOCAB, -math.inf)
                shown[kept] = np.log(b)
            order = np.argsort(-shown, kind="stable")[: body["logprobs"]]
            # vLLM clamps -inf to -9999.0 in completions' logprobs
            top = {f"token_id:{i}": max(float(shown[i]), -9999.0) for i in order}
            top[f"token_id:{x}"] = max(float(shown[x]), -9999.0)
            seq.append(x)
            ids.append(x)
            lps.append(max(float(shown[x]), -9999.0))
            tops.append(top)
            rows.append(sorted(int(i) for i in kept))  # vocabulary order, as a GPU mask gives
            if x in body["stop_token_ids"]:
                finish = "stop"
                break
        choice = {"index": 0, "text": "", "finish_reason": finish, "stop_reason": None,
                  "logprobs": {"text_offset": list(range(len(ids))), "token_logprobs": lps,
                               "tokens": [f"token_id:{i}" for i in ids], "top_logprobs": tops}}
        if body.get("return_token_ids"):
            choice["token_ids"] = ids
        if body.get("return_sampling_mask") and self.mask == "csr":
            choice["sampling_mask"] = {"token_ids": [i for r in rows for i in r],
                                       "offsets": np.cumsum([0] + [len(r) for r in rows]).tolist()}
        elif body.get("return_sampling_mask") and self.mask == "nested":
            choice["sampling_mask"] = rows
        return 200, {"id": "cmpl-1", "object": "text_completion", "model": MODEL,
                     "choices": [choice], "usage": {"prompt_tokens": len(body["prompt"]),
                                                    "completion_tokens": len(ids)}}


@pytest.fixture
def fake():
    server = FakeVLLM()
    yield server
    server.close()


def _check_records(c, params, version=0):
    """Every record against the fake model's exact distribution at that position."""
    seq = c.prompt_ids + c.token_ids
    for t, x in enumerate(c.token_ids):
        z = _table(version)[seq[len(c.prompt_ids) + t - 1] % VOCAB]
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


@pytest.mark.parametrize("mask", ["csr", "nested", None])
def test_generate_maps_raw_logprobs_and_sampling_masks_to_records(mask):
    server = FakeVLLM(mask=mask)
    try:
        backend = VLLMBackend(server.url, support_logprobs_num=VOCAB)
        params = SamplingParams(temperature=1.0, top_p=0.8, head_k=5, max_new_tokens=6, seed=3)
        outs = backend.generate([[1, 2], [3], [4, 5, 6]], params)
        assert [c.index for c in outs] == [0, 1, 2] and [c.seed for c in outs] == [3, 4, 5]
        for c in outs:
            assert len(c.token_ids) == 6 and c.finish_reason == "length" and c.versions == [0] * 6
            _check_records(c, params)
        bodies = sorted((b for p, b in server.requests if p == "/v1/completions"),
                        key=lambda b: b["seed"])
        assert [b["seed"] for b in bodies] == [3, 4, 5]  # one request per sample, its own seed
        assert bodies[0]["top_k"] == -1 and bodies[0]["logprobs"] == VOCAB
        assert bodies[0]["return_sampling_mask"] is True and bodies[0]["return_token_ids"]
    finally:
        server.close()


def test_top_k_greedy_untruncated_and_stop_tokens(fake):
    backend = VLLMBackend(fake.url)
    per_request = [SamplingParams(top_k=4, top_p=0.9, head_k=3, max_new_tokens=5, seed=1),
                   SamplingParams(temperature=0, head_k=2, max_new_tokens=5, seed=2),
                   SamplingParams(temperature=1.0, head_k=4, max_new_tokens=5, seed=3)]
    top_k, greedy, full = backend.generate([[1], [2], [3]], per_request)
    _check_records(top_k, per_request[0])
    assert all(len(s) <= 4 for s in top_k.support_ids)
    assert greedy.support_ids == [[x] for x in greedy.token_ids] and greedy.logprobs == [0.0] * 5
    _check_records(greedy, per_request[1])
    assert full.support_ids is None
    _check_records(full, per_request[2])
    untruncated = next(b for p, b in fake.requests if p == "/v1/completions" and b["seed"] == 3)
    assert "return_sampling_mask" not in untruncated
    stop = full.token_ids[2]
    c = backend.generate([[3]], SamplingParams(head_k=4, max_new_tokens=5, seed=3,
                                               stop_token_ids=(stop,)))[0]
    assert c.finish_reason == "stop" and c.token_ids == full.token_ids[: full.token_ids.index(stop)
                                                                         + 1]


def test_processed_logprobs_mode_is_exact_without_truncation_and_refuses_otherwise():
    server = FakeVLLM(logprobs_mode="processed_logprobs")
    try:
        backend = VLLMBackend(server.url, logprobs_mode="processed_logprobs")
        params = SamplingParams(temperature=0.7, head_k=5, max_new_tokens=5, seed=4)
        _check_records(backend.generate([[9]], params)[0], params)
        with pytest.raises(VLLMError, match="processed_logprobs: vLLM reports no log q"):
            backend.generate([[9]], SamplingParams(temperature=0.7, top_p=0.9))
    finally:
        server.close()
    with pytest.raises(VLLMError, match="raw_logprobs are before temperature"):
        VLLMBackend("http://127.0.0.1:9").generate([[1]], SamplingParams(temperature=0.7))


def test_load_weights_pauses_between_requests_and_versions_follow(fake, exports):
    good, corrupt = exports
    backend = VLLMBackend(fake.url, version=0)
    with pytest.raises(WeightLoadError, match="config.json"):
        backend.load_weights(corrupt, 1)  # refused here: the server never hears of it
    assert not fake.requests and backend.version == 0
    fake.delay = 0.3
    params = SamplingParams(max_new_tokens=3, seed=0)
    results = {}
    slow = threading.Thread(target=lambda: results.update(a=backend.generate([[1]], params)))
    slow.start()
    time.sleep(0.1)  # the request is in flight: the reload waits for it
    backend.load_weights(good, 1)
    slow.join()
    assert fake.events == ["completion", "pause", f"update {good.resolve()}", "resume"]
    assert results["a"][0].versions == [0, 0, 0]
    assert backend.version == 1 and fake.version == 1
    c = backend.generate([[1]], params)[0]
    assert c.versions == [1, 1, 1]
    _check_records(c, params, version=1)
    with pytest.raises(WeightLoadError, match="must be a local directory"):
        backend.load_weights("/exports/bad_v2", 2, verify=False)  # the server refuses
    assert backend.version == 1 and fake.events[-1] == "resume"  # resumed after the failure
    paths = [p for p, _ in fake.requests]
    assert paths.count("/init_weight_transfer_engine") == 1


def test_bad_responses_and_unreachable_servers_raise(fake):
    fake.completions = lambda body, query: (200, {"choices": [{
        "token_ids": [1, 2], "finish_reason": "length",
        "logprobs": {"token_logprobs": [-1.0], "top_logprobs": [{}], "tokens": ["token_id:1"]}}]})
    with pytest.raises(VLLMError, match="2 output ids but 1 logprobs"):
        VLLMBackend(fake.url).generate([[1]], SamplingParams(max_new_tokens=2))
    fake.completions = lambda body, query: (400, {"object": "error", "message":
                                                  "logprobs 256 exceeds --max-logprobs 20"})
    with pytest.raises(VLLMError, match="max-logprobs 20"):
        VLLMBackend(fake.url).generate([[1]], SamplingParams(top_p=0.9, max_new_tokens=2))
    url = fake.url
    fake.close()
    with pytest.raises(VLLMError, match="unreachable"):
        VLLMBackend(url, timeout=2).generate([[1]], SamplingParams(max_new_tokens=2))


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


def test_server_args_per_recipe():
    args = vllm_server_args(get_recipe("fp8", kv_cache_dtype="fp8_e4m3"))
    assert args[:4] == ["--dtype", "bfloat16", "--kv-cache-dtype", "fp8_e4m3"]
    assert args[-2:] == ["--quantization", "fp8"]
    assert "--return-sampling-mask" in args and args[args.index("--logprobs-mode") + 1] == \
        "raw_logprobs"
    assert json.loads(args[args.index("--weight-transfer-config") + 1]) == {"backend": "disk"}
    assert vllm_server_args(get_recipe("nvfp4_w4a4"))[-1] == "modelopt_fp4"
    assert "--quantization" not in vllm_server_args(get_recipe("bf16"))
    for name in ("int8", "mxfp4_w4a16"):
        with pytest.raises(RecipeError, match="torch engine"):
            vllm_server_args(get_recipe(name))


def test_mixrl_sample_backend_vllm_attaches_and_reports_its_backend(fake, exports, tmp_path,
                                                                   monkeypatch):
    """``mixrl-sample --backend vllm --server-url URL`` joins a live rollout service: it
    registers with recipe backend "vllm" and submits what the server generated."""
    from sampler_torch.cli import main
    from trainer_jax.config import load_config
    from trainer_jax.service import RolloutService

    svc = RolloutService.from_config(load_config(None, [
        "service.listen=127.0.0.1:0", "tasks.group_size=2", "tasks.sampling.top_p=0.9",
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
    assert sum(p == "/v1/completions" for p, _ in fake.requests) >= 4


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
    path, _ = hf_model_dir("dense_tied_gqa2")
    return good_and_corrupt_exports(path, tmp_path_factory.mktemp("vl"))


@pytest.mark.gpu
@pytest.mark.skipif(not vllm_available(), reason="needs vllm and a CUDA GPU")
def test_live_vllm_server(exports, tmp_path):
    good, _ = exports
    with VLLMBackend.launch(good, "bf16", version=1, log_path=tmp_path / "vllm.log",
                            extra_args=["--gpu-memory-utilization", "0.3",
                                        "--enforce-eager"]) as backend:
        params = SamplingParams(temperature=1.0, top_p=0.9, head_k=5, max_new_tokens=8, seed=0)
        outs = backend.generate([[1, 2, 3], [4, 5]], params)
        for c in outs:
            assert len(c.token_ids) == len(c.logprobs) == len(c.support_ids) == len(c.versions)
            for t, x in enumerate(c.token_ids):
                assert x in c.support_ids[t] and c.logprobs[t] >= c.logprobs_full[t] - 1e-4
                assert np.exp(c.support_logprobs[t]).sum() == pytest.approx(1.0, abs=1e-3)
            assert c.versions == [1] * len(c.token_ids)
        backend.load_weights(good, 2)
        assert backend.generate([[1]], params)[0].versions[0] == 2
