"""The SGLang backend against a local HTTP server (a real socket) that answers in SGLang's
``/generate`` and ``/update_weights_from_disk`` wire format, plus a live test for GPU hosts.

The fake server's "model" is a fixed table of next-token logits per weights version, indexed by
the previous token, so the test knows every distribution exactly and checks the backend's
conversion (SGLang's post-temperature logprobs -> the behaviour record) against it."""

import math

import numpy as np
import pytest
from fake_http import JSONServer, good_and_corrupt_exports

from sampler_torch.backends import SGLangBackend, SGLangError, server_args, sglang_available
from sampler_torch.engine import SamplingParams
from sampler_torch.recipes import RecipeError, WeightLoadError, get_recipe

VOCAB = 40


def _table(version: str) -> np.ndarray:
    return np.random.default_rng(int(version) + 100).normal(size=(VOCAB, VOCAB)) * 2


def _logq(version: str, prev: int, temperature: float) -> np.ndarray:
    z = _table(version)[prev] / (temperature if temperature > 1e-6 else 1.0)
    return z - np.log(np.exp(z - z.max()).sum()) - z.max()


class FakeSGLang(JSONServer):
    """A toy server speaking SGLang 0.5's HTTP API (``--skip-tokenizer-init``)."""

    def __init__(self, *, native_mask: bool = True, spans: bool = True):
        self.native_mask, self.spans = native_mask, spans
        self.version = "0"
        self.switch_after: tuple[int, str] | None = None  # (tokens, version) for the next call
        super().__init__()

    def route(self, method, path, body, query):
        if method == "GET":
            return (200, {}) if path == "/health" else (404, {})
        if path == "/generate":
            return self.generate(body)
        if path == "/update_weights_from_disk":
            return self.update(body)
        return 404, {"detail": "Not Found"}

    def update(self, body):
        if "bad" in body["model_path"]:
            return 400, {"success": False, "message": "Failed to update weights: shape mismatch. "
                         "Rolling back to the previous weights.", "num_paused_requests": 0}
        self.version = body.get("weight_version") or self.version
        return 200, {"success": True, "message": "Succeeded to update model weights.",
                     "num_paused_requests": 0}

    def generate(self, body):
        if "return_sampling_mask" in body and not self.native_mask:
            return 400, {"error": {"message": "GenerateReqInput.__init__() got an unexpected "
                                              "keyword argument 'return_sampling_mask'"}}
        n = len(body["input_ids"])
        masks = body.get("return_sampling_mask", [False] * n)
        switch, self.switch_after = self.switch_after, None
        return 200, [self._one(ids, sp, top_n, mask, switch) for ids, sp, top_n, mask in zip(
            body["input_ids"], body["sampling_params"], body["top_logprobs_num"], masks,
            strict=True)]

    def _one(self, ids, sp, top_n, want_mask, switch):
        rng = np.random.default_rng(sp["sampling_seed"])
        temp, top_p, top_k = sp["temperature"], sp["top_p"], sp["top_k"]
        if temp < 1e-6:  # SGLang: greedy is top_k = 1 at temperature 1
            temp, top_k = 1.0, 1
        seq, out, lps, tops, masks, mask_lps, spans = list(ids), [], [], [], [], [], []
        version, finish = self.version, {"type": "length", "length": sp["max_new_tokens"]}
        for t in range(sp["max_new_tokens"]):
            if switch and t == switch[0]:
                version = self.version = switch[1]
            if not spans or spans[-1]["version"] != version:
                spans.append({"version": version, "start": t, "end": t})
            logq = _logq(version, seq[-1], temp)
            q = np.exp(logq)
            order = np.argsort(-q, kind="stable")
            before = np.cumsum(q[order]) - q[order]
            keep = order[(before <= top_p) & ((top_k < 0) | (np.arange(VOCAB) < top_k))]
            b = q[keep] / q[keep].sum()
            x = int(rng.choice(keep, p=b))
            seq.append(x)
            out.append(x)
            lps.append([float(logq[x]), x, None])
            tops.append([[float(logq[i]), int(i), None] for i in order[:top_n]])
            masks.append(sorted(int(i) for i in keep))  # vocabulary order, as a GPU mask gives
            mask_lps.append(float(np.log(q[x] / q[keep].sum())))
            spans[-1]["end"] = t + 1
            if x in sp["stop_token_ids"]:
                finish = {"type": "stop", "matched": x}
                break
        meta = {"id": "rid", "finish_reason": finish, "prompt_tokens": len(ids),
                "weight_version": version, "completion_tokens": len(out), "cached_tokens": 0,
                "output_token_logprobs": lps, "output_top_logprobs": tops}
        if self.spans:
            meta["weight_versions"] = spans
        if want_mask:
            meta.update(output_token_sampling_mask=masks, output_token_sampling_logprobs=mask_lps,
                        output_token_sampling_mask_length=len(out))
        return {"output_ids": out, "meta_info": meta}


@pytest.fixture
def fake():
    server = FakeSGLang()
    yield server
    server.close()


def _check_records(c, params, versions=None):
    """Every record against the fake model's exact distribution at that position."""
    seq = c.prompt_ids + c.token_ids
    for t, x in enumerate(c.token_ids):
        version = str(c.versions[t] if versions is None else versions[t])
        logq = _logq(version, seq[len(c.prompt_ids) + t - 1], params.temperature)
        assert c.logprobs_full[t] == pytest.approx(logq[x], abs=1e-9)
        order = np.argsort(-logq, kind="stable")
        assert c.head_ids[t] == order[: params.head_k].tolist()
        np.testing.assert_allclose(c.head_logprobs[t], logq[order[: params.head_k]], atol=1e-9)
        if c.support_ids is None:
            assert c.logprobs[t] == c.logprobs_full[t]
            continue
        q = np.exp(logq[order])
        top_k = params.top_k if params.top_k > 0 else VOCAB
        kept = order[(np.cumsum(q) - q <= params.top_p) & (np.arange(VOCAB) < top_k)]
        assert c.support_ids[t] == kept.tolist() and x in c.support_ids[t]
        log_mass = math.log(np.exp(logq[kept]).sum())
        np.testing.assert_allclose(c.support_logprobs[t], logq[kept] - log_mass, atol=1e-9)
        assert c.logprobs[t] == pytest.approx(logq[x] - log_mass, abs=1e-9)


@pytest.mark.parametrize("native_mask", [True, False])
def test_generate_maps_sglang_logprobs_to_behaviour_records(native_mask):
    server = FakeSGLang(native_mask=native_mask)
    try:
        backend = SGLangBackend(server.url, support_logprobs_num=VOCAB)
        params = SamplingParams(temperature=0.7, top_p=0.85, head_k=5, max_new_tokens=7, seed=3)
        outs = backend.generate([[1, 2], [3], [4, 5, 6]], params)
        assert [c.index for c in outs] == [0, 1, 2] and [c.seed for c in outs] == [3, 4, 5]
        for c in outs:
            assert len(c.token_ids) == 7 and c.finish_reason == "length" and c.versions == [0] * 7
            _check_records(c, params)
        _, body = server.requests[-1]
        assert body["sampling_params"][0]["top_k"] == -1 and body["return_logprob"] is True
        assert body["top_logprobs_num"] == [VOCAB] * 3
        assert ("return_sampling_mask" in body) == native_mask
        assert backend.native_sampling_mask == native_mask
    finally:
        server.close()


def test_top_k_greedy_and_untruncated_requests(fake):
    backend = SGLangBackend(fake.url)
    per_request = [SamplingParams(top_k=4, head_k=3, max_new_tokens=5, seed=1),
                   SamplingParams(temperature=0, head_k=2, max_new_tokens=5, seed=2),
                   SamplingParams(temperature=1.2, head_k=4, max_new_tokens=5, seed=3)]
    top_k, greedy, full = backend.generate([[1], [2], [3]], per_request)
    _check_records(top_k, per_request[0])
    assert all(len(s) <= 4 for s in top_k.support_ids)
    assert greedy.support_ids == [[x] for x in greedy.token_ids] and greedy.logprobs == [0.0] * 5
    assert full.support_ids is None
    _check_records(full, per_request[2])
    _, body = fake.requests[-1]
    assert body["return_sampling_mask"] == [True, True, False]
    assert body["top_logprobs_num"] == [4, 2, 4]


def test_stop_tokens_and_in_flight_version_spans(fake):
    backend = SGLangBackend(fake.url)
    params = SamplingParams(top_p=0.9, head_k=3, max_new_tokens=8, seed=5)
    free = backend.generate([[7]], params)[0]
    stop = free.token_ids[3]
    c = backend.generate([[7]], SamplingParams(top_p=0.9, head_k=3, max_new_tokens=8, seed=5,
                                               stop_token_ids=(stop,)))[0]
    assert c.finish_reason == "stop" and c.token_ids == free.token_ids[: free.token_ids.index(stop)
                                                                          + 1]
    fake.switch_after = (3, "1")  # the server reloads after the 3rd token of the next request
    c = backend.generate([[7]], params)[0]
    assert c.versions == [0, 0, 0, 1, 1, 1, 1, 1]
    _check_records(c, params)


def test_versions_without_spans_use_the_single_weight_version():
    server = FakeSGLang(spans=False)
    try:
        server.version = "4"
        c = SGLangBackend(server.url).generate([[1]], SamplingParams(max_new_tokens=3, seed=0))[0]
        assert c.versions == [4, 4, 4]
    finally:
        server.close()


@pytest.fixture(scope="module")
def exports(hf_model_dir, tmp_path_factory):
    path, _ = hf_model_dir("dense_tied_gqa2")
    return good_and_corrupt_exports(path, tmp_path_factory.mktemp("sg"))


def test_load_weights_verifies_then_reloads(fake, exports):
    good, corrupt = exports
    backend = SGLangBackend(fake.url, version=0)
    with pytest.raises(WeightLoadError, match="config.json"):
        backend.load_weights(corrupt, 1)  # refused here: the server never hears of it
    assert not fake.requests and backend.version == 0
    backend.load_weights(good, 1)
    path, body = fake.requests[-1]
    assert path == "/update_weights_from_disk"
    assert body == {"model_path": str(good), "weight_version": "1", "abort_all_requests": False}
    assert backend.version == 1 and fake.version == "1"
    with pytest.raises(WeightLoadError, match="Rolling back"):
        backend.load_weights("/exports/bad_v2", 2, verify=False)  # the server refuses
    assert backend.version == 1
    c = backend.generate([[1]], SamplingParams(max_new_tokens=2, seed=0))[0]
    assert c.versions == [1, 1]


def test_bad_responses_and_unreachable_servers_raise(fake):
    fake.generate = lambda body: (200, [{"output_ids": [1, 2], "meta_info": {
        "output_token_logprobs": [[-1.0, 1, None]], "output_top_logprobs": [[]],
        "finish_reason": {"type": "length"}}}])
    with pytest.raises(SGLangError, match="2 output ids but 1 logprobs"):
        SGLangBackend(fake.url).generate([[1]], SamplingParams(max_new_tokens=2))
    fake.generate = lambda body: (200, [{"output_ids": [], "meta_info": {
        "output_token_logprobs": [], "output_top_logprobs": [],
        "finish_reason": {"type": "abort", "message": "out of memory"}}}])
    with pytest.raises(SGLangError, match="out of memory"):
        SGLangBackend(fake.url).generate([[1]], SamplingParams(max_new_tokens=2))
    url = fake.url
    fake.close()
    with pytest.raises(SGLangError, match="unreachable"):
        SGLangBackend(url, timeout=2).generate([[1]], SamplingParams(max_new_tokens=2))


def test_server_args_per_recipe():
    assert server_args(get_recipe("fp8", kv_cache_dtype="fp8_e4m3")) == [
        "--dtype", "bfloat16", "--kv-cache-dtype", "fp8_e4m3", "--quantization", "fp8"]
    assert server_args(get_recipe("nvfp4_w4a4"))[-2:] == ["--quantization", "modelopt_fp4"]
    assert server_args(get_recipe("int8"))[-1] == "w8a8_int8"
    assert "--quantization" not in server_args(get_recipe("bf16"))
    with pytest.raises(RecipeError, match="torch engine"):
        server_args(get_recipe("mxfp4_w4a16"))


@pytest.mark.gpu
@pytest.mark.skipif(not sglang_available(), reason="needs sglang and a CUDA GPU")
def test_live_sglang_server(exports, tmp_path):
    good, _ = exports
    with SGLangBackend.launch(good, "bf16", version=1, log_path=tmp_path / "sglang.log",
                              extra_args=["--mem-fraction-static", "0.3"]) as backend:
        params = SamplingParams(temperature=0.9, top_p=0.9, head_k=5, max_new_tokens=8, seed=0)
        outs = backend.generate([[1, 2, 3], [4, 5]], params)
        for c in outs:
            assert len(c.token_ids) == len(c.logprobs) == len(c.support_ids) == len(c.versions)
            for t, x in enumerate(c.token_ids):
                assert x in c.support_ids[t] and c.logprobs[t] >= c.logprobs_full[t] - 1e-4
                assert np.exp(c.support_logprobs[t]).sum() == pytest.approx(1.0, abs=1e-3)
            assert c.versions == [1] * len(c.token_ids)
        backend.load_weights(good, 2)
        assert backend.generate([[1]], params)[0].versions[0] == 2
