"""Partial rollouts on the SGLang backend (issue 34) against the contract server
(``tests/fake_sglang.py``, SGLang 0.5.21's routes; a request there takes time and a reload lands
in its middle): with ``partial_rollouts`` on, a reload pauses in place, the request spans it and
its records carry both versions, each token checked against the distribution of its version;
the radix cache, still holding old-weight prefixes, is flushed once nothing is in flight (before
the next request, and before the probe is scored). With it off, the reload waits until the
request has finished on the old weights and holds the next request back until it is done."""

import threading
import time

import numpy as np
import pytest
from fake_http import good_and_corrupt_exports
from fake_sglang import FakeSGLang, kept, logq

from sampler_torch.backends import SGLangBackend
from sampler_torch.engine import SamplingParams

PARAMS = SamplingParams(temperature=0.8, top_k=6, head_k=3, max_new_tokens=40, seed=4)


@pytest.fixture(scope="module")
def _server():
    server = FakeSGLang()
    yield server
    server.close()


@pytest.fixture
def fake(_server):
    _server.reset(token_delay=0.025)
    return _server


@pytest.fixture(scope="module")
def export(hf_model_dir, tmp_path_factory):
    path, _ = hf_model_dir("dense_tied_gqa2")
    return good_and_corrupt_exports(path, tmp_path_factory.mktemp("pr"))[0]


def _check_records(c, params):
    """Each token's record against the fake model's distribution at the version it claims."""
    seq = c.prompt_ids + c.token_ids
    for t, x in enumerate(c.token_ids):
        lq = logq(str(c.versions[t]), seq[len(c.prompt_ids) + t - 1], params.temperature)
        keep = kept(lq, params.top_p, params.top_k)
        assert c.logprobs_full[t] == pytest.approx(lq[x], abs=1e-9)
        assert c.support_ids[t] == keep.tolist()
        log_mass = np.log(np.exp(lq[keep]).sum())
        assert c.logprobs[t] == pytest.approx(lq[x] - log_mass, abs=1e-9)


def _in_thread(fn, *args):
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("value", fn(*args)))
    t.start()
    return t, out


def _backend(fake) -> SGLangBackend:
    backend = SGLangBackend(fake.url, version=0)
    fake.produced = 0  # not counting the start-up check's token
    return backend


def _started(fake, tokens: int):
    """Wait until the request in flight has produced ``tokens`` tokens."""
    _wait(lambda: fake.produced >= tokens, "the request to start")


def _wait(cond, what: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.002)


def test_in_place_reload_spans_a_long_request_then_the_cache_is_flushed(fake, export):
    backend = _backend(fake)
    assert backend.partial_rollouts is True  # the default, as train.partial_rollouts
    gen, out = _in_thread(backend.generate, [[7]], PARAMS)
    _started(fake, 5)
    sent = len(fake.requests)
    backend.load_weights(export, 1)  # returns while the request still runs
    assert gen.is_alive() and backend.version == 1
    assert [p for p, _ in fake.requests[sent:]] == [
        "/pause_generation", "/update_weights_from_disk", "/continue_generation"]
    assert fake.requests[sent][1] == {"mode": "in_place"}
    assert fake.requests[sent + 1][1]["flush_cache"] is False  # SGLang asserts on a flush now
    # The probe is scored only once the request has ended and the old prefixes are flushed.
    score, scored = _in_thread(backend.score, [[1, 2]], [[3, 4]])
    gen.join(60)
    score.join(60)
    c = out["value"][0]
    cut = c.versions.index(1)
    assert 5 <= cut < 40 and c.versions == [0] * cut + [1] * (40 - cut)
    _check_records(c, PARAMS)  # each token against the distribution of its own version
    after = [p for p, _ in fake.requests[sent + 3:]]
    assert after == ["/flush_cache", "/generate"] and fake.flushes == 1
    assert len(scored["value"][0]) == 2
    nxt = backend.generate([[7]], SamplingParams(max_new_tokens=3, seed=1))[0]
    assert nxt.versions == [1, 1, 1] and fake.requests[-1][0] == "/generate"  # flushed once


def test_a_flush_refused_while_requests_run_is_retried_before_the_next_request(fake, export):
    backend = _backend(fake)
    gen, _ = _in_thread(backend.generate, [[7]], PARAMS)
    _started(fake, 3)
    backend.load_weights(export, 1)
    assert backend._flush() is False  # the server refuses while the request runs
    gen.join(60)
    backend.generate([[5]], SamplingParams(max_new_tokens=2, seed=2))
    assert [p for p, _ in fake.requests[-3:]] == ["/flush_cache", "/flush_cache", "/generate"]
    assert fake.flushes == 1


def test_without_partial_rollouts_the_reload_waits_for_the_request(fake, export):
    backend = _backend(fake)
    backend.set_partial_rollouts(False)
    first, out1 = _in_thread(backend.generate, [[7]], PARAMS)
    _started(fake, 5)
    load, _ = _in_thread(backend.load_weights, export, 1)
    _wait(lambda: backend._gate.draining, "the reload to wait")
    second, out2 = _in_thread(backend.generate, [[9]], SamplingParams(max_new_tokens=4, seed=3))
    for t in (first, load, second):
        t.join(60)
    assert out1["value"][0].versions == [0] * 40  # finished on the weights it started with
    assert out2["value"][0].versions == [1] * 4   # held back until the reload was done
    paths = [p for p, _ in fake.requests]
    pause = paths.index("/pause_generation")
    assert paths[pause:pause + 4] == ["/pause_generation", "/update_weights_from_disk",
                                      "/continue_generation", "/generate"]
    assert fake.requests[pause][1] == {"mode": "retract"}
    assert fake.requests[pause + 1][1]["flush_cache"] is True and fake.flushes == 1
