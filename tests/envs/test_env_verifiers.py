"""``env: verifiers`` (issue 38 item 2) with the real ``verifiers`` 0.4 package.

The endpoint tests post real HTTP to ``envs.verifiers_endpoint`` and read the answers with the
parsing functions of ``renderers.client`` (what the training client runs on them). The episode
tests run a single-turn taskset (``vf_echo``) and a multi-turn ``Env`` (``vf_guess``, the
environment plays the user) defined beside this file, in this process: ``verifiers`` renders the
chat with the model directory's template (``chat_dir``), calls the endpoint, and mixrl's episode
driver (``envs.rollout.run_episodes``) answers with scripted turns and log-probs. The end-to-end
run (``mixrl-train``, two sampler groups) is ``test_env_verifiers_e2e.py``.
"""

from __future__ import annotations

import json
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from envs.verifiers_endpoint import GenerateEndpoint

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))  # vf_echo / vf_guess: the taskset ids the tests name



def _post(url: str, body: dict | bytes) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_endpoint_answers_generate_and_models_as_vllm_does():
    from renderers.client import _parse_completion_logprobs, parse_generate_response

    endpoint = GenerateEndpoint(vocab_size=50, max_model_len=256)
    try:
        calls = endpoint.route("policy-a")
        root = endpoint.base_url.removesuffix("/v1")
        body = {"model": "policy-a", "token_ids": [1, 2, 3],
                "sampling_params": {"stop_token_ids": [7], "logprobs": 1, "max_tokens": 8,
                                    "temperature": 0.3}}
        answer: dict = {}

        def post():
            answer["status"], answer["body"] = _post(f"{root}/inference/v1/generate", body)

        t = threading.Thread(target=post)
        t.start()
        kind, call = calls.get(timeout=30)
        assert kind == "call" and call.prompt_ids == [1, 2, 3] and call.stop_token_ids == [7]
        assert call.max_tokens == 8
        call.answer([4, 5, 7], [-0.5, -1.25, -0.125], "stop")
        t.join(30)
        assert answer["status"] == 200
        raw = parse_generate_response(json.dumps(answer["body"]).encode())
        choice = raw["choices"][0]
        assert choice["token_ids"] == [4, 5, 7] and choice["finish_reason"] == "stop"
        assert _parse_completion_logprobs(choice, [4, 5, 7]) == [-0.5, -1.25, -0.125]
        with urllib.request.urlopen(f"{endpoint.base_url}/models", timeout=30) as r:
            models = json.loads(r.read())
        assert models["data"] == [{"id": "policy-a", "object": "model", "max_model_len": 256}]
    finally:
        endpoint.close()


@pytest.mark.parametrize("body, status, words", [
    ({"model": "policy-a", "token_ids": [1, 99]}, 400, "below 50"),
    ({"model": "policy-a", "token_ids": []}, 400, "non-empty"),
    ({"model": "policy-a", "token_ids": [1], "sampling_params": {"stop_token_ids": ["x"]}}, 400,
     "stop_token_ids"),
    ({"model": "policy-a", "token_ids": [1], "sampling_params": {"max_tokens": 0}}, 400, "max_tokens"),
    ({"model": "policy-a", "token_ids": [1], "content_parts": [{"type": "image"}]}, 400, "multimodal"),
    ({"model": "nobody", "token_ids": [1]}, 404, "no episode"),
    (b"{not json", 400, "not JSON"),
])
def test_the_endpoint_refuses_what_it_cannot_serve_in_one_line(body, status, words):
    endpoint = GenerateEndpoint(vocab_size=50)
    try:
        endpoint.route("policy-a")
        code, answer = _post(f"{endpoint.base_url.removesuffix('/v1')}/inference/v1/generate", body)
        assert code == status and words in answer["error"], answer
    finally:
        endpoint.close()


def test_a_waiting_call_gets_503_when_the_endpoint_closes():
    endpoint = GenerateEndpoint(vocab_size=50)
    calls = endpoint.route("m")
    out: list = []
    url = f"{endpoint.base_url.removesuffix('/v1')}/inference/v1/generate"
    t = threading.Thread(target=lambda: out.append(_post(url, {"model": "m", "token_ids": [1]})))
    t.start()
    calls.get(timeout=30)
    endpoint.close()
    t.join(30)
    assert out and out[0][0] == 503


def test_an_episode_that_wants_logprobs_gets_each_turns_through_a_worker():
    """The driver hands ``turn_logprobs`` to an episode that ``wants_logprobs`` before ``step``;
    through ``envs.isolated``'s worker they ride the step request (``logprobs_env`` answers with
    them, scaled to ids)."""
    from convert.tokenizer import char_tokenizer
    from envs.isolated import IsolatedEnvironment
    from envs.rollout import run_episodes
    from mixrl_wire.sampling import SamplingParams

    env = IsolatedEnvironment("logprob_env:LogprobEnv", char_tokenizer(), options={"timeout_s": 60})
    try:
        episode = env.start(env.sample_task_at(np.random.default_rng(0), "t0", 0))
        assert episode.wants_logprobs
        turns = iter([([5, 6], [-0.4, -0.7]), ([7], [-1.2])])

        def generate(prompts, params):
            ids, lps = next(turns, ([8], []))
            return [SimpleNamespace(token_ids=ids, logprobs=lps, logprobs_full=lps, versions=[0] * len(ids),
                                    head_ids=[], head_logprobs=[], support_ids=None, support_logprobs=None)]

        (rec,) = run_episodes(generate, [episode], SamplingParams(max_new_tokens=4, head_k=0),
                              max_total_tokens=64)
        episode.close()
    finally:
        env.close()
    assert rec.token_ids.tolist() == [1, 2, 5, 6, 4, 7, 7, 12, 8]  # observations: the log-probs x -10
    assert rec.termination == "answered"
    assert rec.reward_parts == {"turns_seen": 2.0}  # the episode's reward parts, cleaned, via the worker


# -- episodes with the real package -----------------------------------------------------------

pytest.importorskip("verifiers.v1", reason="the verifiers extra is not installed")


@pytest.fixture(scope="module")
def tok(worker_tokenizer):
    """The chat model's tokenizer; episodes run in this process, as in a sampler's env worker
    (elsewhere ``start`` hands them to one: ``test_the_trainer_starts_tasks_in_a_worker``)."""
    return worker_tokenizer  # tests/envs/conftest.py


@pytest.fixture(scope="module")
def echo(tok):
    from envs.loading import make_env

    env = make_env("verifiers", tok, id="vf_echo", args={"count": 3}, eval_args={"split": "eval", "count": 2})
    yield env
    env.close()


@pytest.fixture(scope="module")
def guess(tok):
    from envs.loading import make_env

    env = make_env("verifiers", tok, id="vf_guess", args={"high": 8, "turns": 3})
    yield env
    env.close()


def _engine(tok, replies: list[str]):
    """A scripted engine (the ``Engine.generate`` API): turn j of every request is ``replies[j]``
    then ``<|im_end|>``, with log-prob -0.01 * (position + 1) and version 3."""
    stop = tok.token_to_id("<|im_end|>")
    turn = {"n": 0}

    def generate(prompts, params):
        text = replies[min(turn["n"], len(replies) - 1)]
        turn["n"] += 1
        ids = tok.encode(text, add_special_tokens=False).ids + [stop]
        lps = [-0.01 * (i + 1) for i in range(len(ids))]
        return [SimpleNamespace(token_ids=ids, logprobs=lps, logprobs_full=lps, versions=[3] * len(ids),
                                head_ids=[], head_logprobs=[], support_ids=None, support_logprobs=None)
                for _ in prompts]

    return generate


def _params():
    from mixrl_wire.sampling import SamplingParams

    return SamplingParams(max_new_tokens=16, head_k=0)


def test_the_taskset_is_the_task_source_with_its_eval_split(echo, tok):
    rng = np.random.default_rng(0)
    words = [echo.sample_task_at(rng, f"t{i}", i).payload["data"]["word"] for i in range(4)]
    assert words == ["hello", "world", "answer", "hello"]  # 3 tasks, read in order, then again
    held_out = echo.for_evaluation()
    try:
        assert [held_out.sample_task_at(rng, f"e{i}", i).payload["data"]["word"] for i in range(2)] == \
            ["think", "step"]
    finally:
        held_out.close()


def test_a_single_turn_episode_is_scored_by_the_rubric(echo, tok):
    from envs.rollout import run_episodes

    task = echo.sample_task_at(np.random.default_rng(0), "t0", 0)
    episode = echo.start(task)
    assert tok.decode(episode.prompt, skip_special_tokens=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay the word hello.<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert episode.stop_token_ids == (tok.token_to_id("<|im_end|>"),)
    (rec,) = run_episodes(_engine(tok, ["hello there"]), [episode], _params(), max_total_tokens=256)
    episode.close()
    assert rec.termination == "answered" and rec.turns == 1
    assert rec.reward == pytest.approx(1.5)  # says_word 1 x 1 + short 1 x 0.5
    assert episode.reward_values == {"says_word": 1.0, "short": 1.0}
    assert rec.reward_parts == {"says_word": 1.0, "short": 1.0}  # Trajectory.reward_parts
    # The reply the rubric read is the driver's tokens; verifiers' own record of the rollout is
    # the trajectory mixrl assembled, with the driver's log-probs on the sampled tokens.
    trace = episode.result.traces[0]
    assert trace.assistant_messages[-1].content == "hello there"
    _same_as_verifiers_record(trace, rec)


def _same_as_verifiers_record(trace, rec) -> None:
    (branch,) = trace.branches
    assert branch.token_ids == rec.token_ids.tolist()
    assert branch.sampled_mask == rec.loss_mask.astype(bool).tolist()
    sampled = [lp for lp, m in zip(branch.logprobs, branch.sampled_mask, strict=True) if m]
    assert sampled == pytest.approx(rec.logprobs.tolist())


def test_a_multi_turn_episode_is_one_trajectory_of_the_calls(guess, tok):
    from envs.rollout import run_episodes, segments

    task = guess.sample_task_at(np.random.default_rng(0), "t0", 0)
    assert task.payload["data"]["secret"] == 4
    episode = guess.start(task)
    (rec,) = run_episodes(_engine(tok, ["1", "7", "4"]), [episode], _params(), max_total_tokens=512)
    episode.close()
    assert rec.termination == "answered" and rec.turns == 3 and rec.reward == 1.0
    text = tok.decode(rec.token_ids.tolist(), skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n1<|im_end|>\n<|im_start|>user\nhigher<|im_end|>\n"
                         "<|im_start|>assistant\n7<|im_end|>\n<|im_start|>user\nlower<|im_end|>\n"
                         "<|im_start|>assistant\n4<|im_end|>")
    policy = [(a, b) for a, b, p in segments(rec.loss_mask) if p]
    assert [tok.decode(rec.token_ids[a:b].tolist(), skip_special_tokens=False) for a, b in policy] == \
        ["1<|im_end|>", "7<|im_end|>", "4<|im_end|>"]
    assert rec.versions.tolist() == [3] * len(rec.logprobs)
    _same_as_verifiers_record(episode.result.traces[0], rec)


def test_a_turn_the_renderer_cannot_bridge_is_refused_and_counted(guess, tok):
    """A reply tokenised otherwise than the renderer re-tokenises it (one id per character) makes
    the next call's prompt no extension of the episode's tokens: the episode ends, counted."""
    from envs.rollout import run_episodes

    stop = tok.token_to_id("<|im_end|>")
    split = [i for ch in "1 2" for i in tok.encode(ch, add_special_tokens=False).ids]
    assert split != tok.encode("1 2", add_special_tokens=False).ids

    def generate(prompts, params):
        ids = split + [stop]
        return [SimpleNamespace(token_ids=ids, logprobs=[-0.1] * len(ids), logprobs_full=[-0.1] * len(ids),
                                versions=[0] * len(ids), head_ids=[], head_logprobs=[], support_ids=None,
                                support_logprobs=None)]

    episode = guess.start(guess.sample_task_at(np.random.default_rng(0), "t1", 1))
    (rec,) = run_episodes(generate, [episode], _params(), max_total_tokens=512)
    episode.close()
    assert rec.termination == "error" and rec.reward == 0.0 and rec.errors == {"bridge_miss": 1}


def test_an_unknown_taskset_is_one_line(tok):
    from envs.loading import EnvLoadError, make_env

    line = r"^environment verifiers \(id 'no_such_taskset'\): cannot load"
    with pytest.raises(EnvLoadError, match=line) as e:
        make_env("verifiers", tok, id="no_such_taskset")
    assert "\n" not in str(e.value)
