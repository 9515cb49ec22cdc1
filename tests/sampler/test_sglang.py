"""The SGLang backend against a local HTTP server (a real socket) speaking SGLang 0.5.21's JSON
(``tests/fake_sglang.py`` cites the files of the ``sglang==0.5.21`` source it follows; SGLang does
not run on these CPU-only machines, so these are contract tests, not live ones), plus a live test
for GPU hosts with sglang installed.

The fake's "model" is a fixed table of next-token logits per weights version, so every record is
checked against the exact distribution it claims."""

import math

import numpy as np
import pytest
from fake_http import good_and_corrupt_exports
from fake_sglang import FakeSGLang, kept, logq

from sampler_torch.backends import SGLangBackend, SGLangError, server_args, sglang_available
from sampler_torch.backends.http_server import free_port
from sampler_torch.engine import SamplingParams
from sampler_torch.recipes import RecipeError, WeightLoadError, get_recipe


@pytest.fixture(scope="module")
def _server():
    server = FakeSGLang()
    yield server
    server.close()


@pytest.fixture
def fake(_server):
    _server.reset()
    return _server


def _check_records(c, params, versions=None):
    """Every record against the fake model's exact distribution at that position."""
    seq = c.prompt_ids + c.token_ids
    for t, x in enumerate(c.token_ids):
        version = str(c.versions[t] if versions is None else versions[t])
        lq = logq(version, seq[len(c.prompt_ids) + t - 1], params.temperature)
        assert c.logprobs_full[t] == pytest.approx(lq[x], abs=1e-9)
        order = np.argsort(-lq, kind="stable")
        assert c.head_ids[t] == order[: params.head_k].tolist()
        np.testing.assert_allclose(c.head_logprobs[t], lq[order[: params.head_k]], atol=1e-9)
        if c.support_ids is None:
            assert c.logprobs[t] == c.logprobs_full[t]
            continue
        keep = kept(lq, params.top_p if params.temperature else 1.0,
                    1 if params.temperature == 0 else params.top_k)
        assert c.support_ids[t] == keep.tolist() and x in c.support_ids[t]
        log_mass = math.log(np.exp(lq[keep]).sum())
        np.testing.assert_allclose(c.support_logprobs[t], lq[keep] - log_mass, atol=1e-9)
        assert c.logprobs[t] == pytest.approx(lq[x] - log_mass, abs=1e-9)


def test_generate_maps_the_sampling_mask_to_behaviour_records(fake):
    backend = SGLangBackend(fake.url)
    params = SamplingParams(temperature=0.7, top_p=0.85, top_k=12, head_k=5, max_new_tokens=7, seed=3)
    outs = backend.generate([[1, 2], [3], [4, 5, 6]], params)
    assert [c.index for c in outs] == [0, 1, 2] and [c.seed for c in outs] == [3, 4, 5]
    for c in outs:
        assert len(c.token_ids) == 7 and c.finish_reason == "length" and c.versions == [0] * 7
        _check_records(c, params)
    _, body = fake.requests[-1]
    sp = body["sampling_params"][0]
    assert sp["top_k"] == 12 and sp["min_p"] == 0.0 and sp["repetition_penalty"] == 1.0
    assert body["return_sampling_mask"] == [True] * 3
    assert body["sampling_logprobs_mode"] == ["support"] * 3
    assert body["top_logprobs_num"] == [5] * 3 and body["return_logprob"] is True


def test_top_k_greedy_untruncated_and_headless_requests(fake):
    backend = SGLangBackend(fake.url)
    per_request = [SamplingParams(top_k=4, head_k=3, max_new_tokens=5, seed=1),
                   SamplingParams(temperature=0, head_k=2, max_new_tokens=5, seed=2),
                   SamplingParams(temperature=1.2, head_k=4, max_new_tokens=5, seed=3),
                   SamplingParams(temperature=0.9, top_p=0.8, top_k=6, head_k=0, max_new_tokens=5)]
    top_k, greedy, full, headless = backend.generate([[1], [2], [3], [4]], per_request)
    _check_records(top_k, per_request[0])
    assert all(len(s) <= 4 for s in top_k.support_ids)
    assert greedy.support_ids == [[x] for x in greedy.token_ids] and greedy.logprobs == [0.0] * 5
    assert full.support_ids is None
    _check_records(full, per_request[2])
    _check_records(headless, per_request[3])
    assert headless.head_ids == [[]] * 5
    _, body = fake.requests[-1]
    assert body["return_sampling_mask"] == [True, True, False, True]
    assert body["sampling_logprobs_mode"] == ["support", "support", None, "support"]
    assert body["top_logprobs_num"] == [3, 2, 4, 0]
    assert body["sampling_params"][1]["top_k"] == 1 and body["sampling_params"][2]["top_k"] == -1


def test_top_p_without_a_top_k_the_mask_can_cover_is_refused(fake):
    backend = SGLangBackend(fake.url)
    sent = len(fake.requests)
    with pytest.raises(SGLangError, match=r"1 <= top_k <= --sampling-mask-max-tokens \(4096\); "
                                          r"set tasks.sampling.top_k"):
        backend.generate([[1]], SamplingParams(top_p=0.9, max_new_tokens=2))
    with pytest.raises(SGLangError, match="top_k lower"):
        backend.generate([[1]], SamplingParams(top_p=0.9, top_k=5000, max_new_tokens=2))
    assert len(fake.requests) == sent  # refused here, before the server heard of it


def test_stop_tokens_and_in_flight_version_spans(fake):
    backend = SGLangBackend(fake.url)
    params = SamplingParams(top_p=0.9, top_k=10, head_k=3, max_new_tokens=8, seed=5)
    free = backend.generate([[7]], params)[0]
    stop = free.token_ids[3]
    c = backend.generate([[7]], SamplingParams(top_p=0.9, top_k=10, head_k=3, max_new_tokens=8,
                                               seed=5, stop_token_ids=(stop,)))[0]
    cut = free.token_ids.index(stop) + 1
    assert c.finish_reason == "stop" and c.token_ids == free.token_ids[:cut]
    fake.switch_after = (3, "1")  # the server reloads after the 3rd token of the next request
    c = backend.generate([[7]], params)[0]
    assert c.versions == [0, 0, 0, 1, 1, 1, 1, 1]
    _check_records(c, params)


@pytest.mark.parametrize(("info", "match"), [
    ({"version": "0.5.20"}, r"runs sglang 0.5.20; mixrl needs sglang>=0.5.21"),
    ({"version": "0.4.6.post5"}, r"sglang>=0.5.21"),
    ({"speculative_algorithm": "EAGLE"}, "without --speculative-algorithm"),
    ({"sampling_backend": "ascend"}, "use --sampling-backend flashinfer or pytorch"),
    ({"rl_on_policy_target": "fsdp"}, "without --rl-on-policy-target"),
    ({"kv_cache_dtype": "fp8_e4m3"}, "runs --kv-cache-dtype fp8_e4m3 but recipe 'bf16' needs "
                                     "--kv-cache-dtype auto"),
    ({"quantization": "fp8"}, "needs no --quantization"),
    ({"preferred_sampling_params": '{"logit_bias": {"3": 5.0}}'}, "preferred-sampling-params with "
                                                                  "logit_bias"),
])
def test_start_up_refuses_servers_whose_records_cannot_be_exact(fake, info, match):
    fake.reset(**info)
    with pytest.raises(SGLangError, match=match) as e:
        SGLangBackend(fake.url)
    assert "\n" not in str(e.value) and fake.url in str(e.value)


def test_start_up_catches_pre_temperature_logprobs_and_accepts_a_matching_recipe(fake):
    fake.reset(original_logprob=True)  # SGLANG_RETURN_ORIGINAL_LOGPROB=1: not in /server_info
    with pytest.raises(SGLangError, match="failed the logprob check.*SGLANG_RETURN_ORIGINAL_LOGPROB"):
        SGLangBackend(fake.url)
    body = fake.requests[-1][1]
    assert body["sampling_params"][0]["temperature"] == 0.5 and body["top_logprobs_num"] == [8]
    fake.reset(kv_cache_dtype="fp8_e4m3", quantization="fp8", version="0.5.23")
    backend = SGLangBackend(fake.url, recipe=get_recipe("fp8", kv_cache_dtype="fp8_e4m3"))
    assert backend.server_info["version"] == "0.5.23" and backend.mask_cap == 4096


@pytest.fixture(scope="module")
def exports(hf_model_dir, tmp_path_factory):
    path, _ = hf_model_dir("dense_tied_gqa2")
    return good_and_corrupt_exports(path, tmp_path_factory.mktemp("sg"))


def test_load_weights_pauses_retracting_reloads_and_checks_what_is_served(fake, exports):
    good, corrupt = exports
    backend = SGLangBackend(fake.url, version=0)
    backend.set_partial_rollouts(False)  # in place: tests/sampler/test_partial_rollouts_servers.py
    sent = len(fake.requests)
    with pytest.raises(WeightLoadError, match="config.json"):
        backend.load_weights(corrupt, 1)  # refused here: the server never hears of it
    assert len(fake.requests) == sent and backend.version == 0
    digest0 = backend.weights_digest()
    backend.load_weights(good, 1)
    assert [p for p, _ in fake.requests[sent:]] == [
        "/weights_checker", "/pause_generation", "/update_weights_from_disk", "/continue_generation"]
    assert fake.requests[sent + 1][1] == {"mode": "retract"}
    assert fake.requests[sent + 2][1] == {"model_path": str(good), "weight_version": "1",
                                          "abort_all_requests": False, "flush_cache": True}
    assert backend.version == 1 and fake.version == "1" and fake.paused is None
    assert backend.weights_digest() != digest0 and len(digest0) == 64
    with pytest.raises(WeightLoadError, match="Rolling back"):
        backend.load_weights("/exports/bad_v2", 2, verify=False)  # the server refuses
    assert backend.version == 1 and fake.paused is None  # generation continues all the same
    c = backend.generate([[1]], SamplingParams(max_new_tokens=2, seed=0))[0]
    assert c.versions == [1, 1]


def test_a_reload_acknowledged_but_not_applied_is_a_load_failure(fake, exports):
    good, _ = exports
    fake.reset(noop_update=True)
    backend = SGLangBackend(fake.url)
    digest = backend.weights_digest()
    with pytest.raises(WeightLoadError, match="acknowledged .* says model_path /exports/v0, "
                                              "weight_version 0"):
        backend.load_weights(good, 3)
    assert backend.version == 0 and backend.weights_digest() == digest


def test_score_returns_raw_prompt_logprobs_of_the_continuation(fake):
    backend = SGLangBackend(fake.url)
    prompts, conts = [[1, 2, 3], [4], [5, 6]], [[7, 8], [9, 10, 11], []]
    scores = backend.score(prompts, conts)
    assert [len(s) for s in scores] == [2, 3, 0]
    for p, c, s in zip(prompts, conts, scores, strict=True):
        seq = p + c
        want = [logq("0", seq[len(p) + t - 1], 1.0)[c[t]] for t in range(len(c))]
        np.testing.assert_allclose(s, want, atol=1e-9)
    _, body = fake.requests[-1]
    assert body["logprob_start_len"] == [2, 0] and len(body["input_ids"]) == 2
    assert body["sampling_params"][0]["max_new_tokens"] == 0
    with pytest.raises(ValueError, match="2 prompts but 1"):
        backend.score([[1], [2]], [[3]])


def test_weights_digest_is_none_without_the_route_and_bad_answers_raise(fake):
    backend = SGLangBackend(fake.url)
    fake.check_weights = lambda body: (404, {"detail": "Not Found"})
    assert backend.weights_digest() is None
    fake.check_weights = lambda body: (400, {"success": False, "message": "no model"})
    with pytest.raises(SGLangError, match="no model"):
        backend.weights_digest()


def test_bad_responses_and_unreachable_servers_raise(fake):
    backend = SGLangBackend(fake.url)
    fake.generate = lambda body: (200, [{"output_ids": [1, 2], "meta_info": {
        "output_token_logprobs": [[-1.0, 1, None]], "finish_reason": {"type": "length"}}}])
    with pytest.raises(SGLangError, match=r"2 output ids but per-token lists of lengths \[1, 2\]"):
        backend.generate([[1]], SamplingParams(max_new_tokens=2, head_k=0))
    fake.generate = lambda body: (200, [{"output_ids": [], "meta_info": {
        "output_token_logprobs": [], "finish_reason": {"type": "abort", "message": "out of memory"}}}])
    with pytest.raises(SGLangError, match="out of memory"):
        backend.generate([[1]], SamplingParams(max_new_tokens=2))
    fake.generate = lambda body: (400, {"error": {"message": "return_sampling_mask is not supported "
                                                             "with speculative decoding."}})
    with pytest.raises(SGLangError, match="HTTP 400.*speculative decoding"):
        backend.generate([[1]], SamplingParams(top_k=3, max_new_tokens=2))
    with pytest.raises(SGLangError, match="unreachable"):  # nothing listens there
        SGLangBackend(f"http://127.0.0.1:{free_port('127.0.0.1')}", timeout=2)


def test_server_args_per_recipe():
    assert server_args(get_recipe("fp8", kv_cache_dtype="fp8_e4m3")) == [
        "--dtype", "bfloat16", "--kv-cache-dtype", "fp8_e4m3", "--sampling-defaults", "openai",
        "--quantization", "fp8"]
    assert server_args(get_recipe("nvfp4_w4a4"))[-2:] == ["--quantization", "modelopt_fp4"]
    assert server_args(get_recipe("int8"))[-1] == "w8a8_int8"
    assert "--quantization" not in server_args(get_recipe("bf16"))
    with pytest.raises(RecipeError, match="torch engine"):
        server_args(get_recipe("mxfp4_w4a16"))


@pytest.mark.gpu
@pytest.mark.skipif(not sglang_available(), reason="needs sglang>=0.5.21 and a CUDA GPU")
def test_live_sglang_server(exports, tmp_path):
    good, _ = exports
    with SGLangBackend.launch(good, "bf16", version=1, log_path=tmp_path / "sglang.log",
                              extra_args=["--mem-fraction-static", "0.3"]) as backend:
        params = SamplingParams(temperature=0.9, top_p=0.9, top_k=20, head_k=5, max_new_tokens=8,
                                seed=0)
        outs = backend.generate([[1, 2, 3], [4, 5]], params)
        for c in outs:
            assert len(c.token_ids) == len(c.logprobs) == len(c.support_ids) == len(c.versions)
            for t, x in enumerate(c.token_ids):
                assert x in c.support_ids[t] and c.logprobs[t] >= c.logprobs_full[t] - 1e-4
                assert np.exp(c.support_logprobs[t]).sum() == pytest.approx(1.0, abs=1e-3)
            assert c.versions == [1] * len(c.token_ids)
        scores = backend.score([[1, 2, 3]], [outs[0].token_ids])[0]
        assert len(scores) == len(outs[0].token_ids) and max(scores) <= 0
        digest = backend.weights_digest()
        backend.load_weights(good, 2)
        assert backend.generate([[1]], params)[0].versions[0] == 2
        assert backend.weights_digest() == digest  # the same files: the same weights
