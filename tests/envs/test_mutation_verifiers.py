"""The verifiers bridge's behaviour its human-style mutants showed untested (issue 46;
docs/testing.md)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from envs.verifiers_env import _reason

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))  # vf_guess: the taskset id the test names


def _snake(name: str) -> str:
    """The reference: "vf_" + the error type's words in lower case joined by "_", only
    [a-z0-9_] kept, at most 40 characters (a metric name)."""
    words = re.findall(r"[A-Z]?[^A-Z]*", name)
    text = "_".join(w.lower() for w in words if w)
    return ("vf_" + "".join(c for c in text if c in "abcdefghijklmnopqrstuvwxyz0123456789_"))[:40]


@pytest.mark.parametrize("error_type, expected", [
    ("TimeoutError", "vf_timeout_error"),
    ("OverlongPromptError", "vf_overlong_prompt_error"),
    ("Weird-Type!", "vf_weird_type"),
    ("ARatherLongErrorTypeNameThatGoesOnAndOn", "vf_a_rather_long_error_type_name_that_go"),
])
def test_a_not_ok_episodes_error_type_names_its_error_counter(error_type, expected):
    # The episode's error counter (and its finish_reason) is "vf_" + the verifiers error type in
    # snake case: each type its own counter, never one nameless "vf_" for all of them.
    assert _reason(error_type) == expected == _snake(error_type)
    assert len(_reason(error_type)) <= 40


def _replying_four(tok):
    """A sampler stand-in whose every reply is "4" then end-of-turn (draw 0's secret in vf_guess):
    ``(generate, the reply's ids)``."""
    ids = _answer_ids(tok)

    def generate(prompts, params):
        return [SimpleNamespace(token_ids=ids, logprobs=[-0.1] * len(ids), logprobs_full=[-0.1] * len(ids),
                                versions=[0] * len(ids), head_ids=[], head_logprobs=[], support_ids=None,
                                support_logprobs=None) for _ in prompts]

    return generate, ids


@pytest.fixture(scope="module")
def guess(worker_tokenizer):  # tests/envs/conftest.py
    pytest.importorskip("verifiers.v1", reason="the verifiers extra is not installed")
    from envs.loading import make_env

    env = make_env("verifiers", worker_tokenizer, id="vf_guess", args={"high": 8, "turns": 2})
    yield env
    env.close()


def test_a_step_after_the_episode_ended_is_refused_by_name(guess, worker_tokenizer):
    # Draw 0's secret is 4: one reply of "4" answers it and the episode ends. Stepping it again
    # is the caller's bug: a RuntimeError saying so, not an AttributeError from the bridge.
    from envs.rollout import run_episodes
    from mixrl_wire.sampling import SamplingParams

    generate, ids = _replying_four(worker_tokenizer)

    episode = guess.start(guess.sample_task_at(np.random.default_rng(0), "t0", 0))
    try:
        (rec,) = run_episodes(generate, [episode], SamplingParams(max_new_tokens=16, head_k=0),
                              max_total_tokens=512)
        assert rec.termination == "answered" and rec.reward == 1.0
        with pytest.raises(RuntimeError, match="^step after the episode ended$"):
            episode.step(ids)
    finally:
        episode.close()


@pytest.fixture(scope="module")
def echo(worker_tokenizer):
    pytest.importorskip("verifiers.v1", reason="the verifiers extra is not installed")
    from envs.loading import make_env

    env = make_env("verifiers", worker_tokenizer, id="vf_echo", args={"count": 2})
    yield env
    env.close()


def test_without_eval_args_evaluation_uses_the_training_taskset_itself(echo):
    # eval_args unset means "default: args": the same environment, not one rebuilt without args.
    assert echo.for_evaluation() is echo
    rng = np.random.default_rng(0)
    assert [echo.sample_task_at(rng, f"e{i}", i).payload["data"]["word"] for i in range(3)] == \
        ["hello", "world", "hello"]  # count 2: two tasks, then again


def test_a_taskset_that_cannot_load_is_one_line_with_the_first_300_characters_of_why(worker_tokenizer):
    pytest.importorskip("verifiers.v1", reason="the verifiers extra is not installed")
    import verifiers.v1 as vf

    from envs.loading import EnvLoadError, make_env
    from envs.verifiers_env import VerifiersOptions, env_config

    args = {"no_such_field_" + "x" * 400: 1}  # refused by the taskset's config: a long message
    with pytest.raises(Exception) as raw:  # whatever verifiers raises, verbatim
        vf.load_environment(env_config(VerifiersOptions(id="vf_echo"), args))
    why = " ".join(str(raw.value).split())
    assert len(why) > 300
    with pytest.raises(EnvLoadError) as e:
        make_env("verifiers", worker_tokenizer, id="vf_echo", args=args)
    assert str(e.value) == (f"environment verifiers (id 'vf_echo'): cannot load it "
                            f"({type(raw.value).__name__}: {why[:300]})")


def _answer_ids(tok) -> list[int]:
    """Draw 0's secret, 4, as a reply that ends its turn."""
    return tok.encode("4", add_special_tokens=False).ids + [tok.token_to_id("<|im_end|>")]


@pytest.mark.parametrize("extra", [2, -1])
def test_a_turn_whose_log_probs_do_not_match_its_tokens_is_answered_with_zeros(guess, worker_tokenizer,
                                                                              extra):
    # In-process use without a driver's record: the log-probs handed over do not match the turn's
    # tokens (more or fewer). The turn is still answered (with 0.0 each), never refused.
    ids = _answer_ids(worker_tokenizer)
    episode = guess.start(guess.sample_task_at(np.random.default_rng(0), "t0", 0))
    try:
        episode.turn_logprobs = [-0.5] * (len(ids) + extra)
        result = episode.step(ids)
        assert (result.done, result.termination, result.reward) == (True, "answered", 1.0)
    finally:
        episode.close()


def test_an_episode_waits_through_a_quiet_second_on_the_verifiers_loop(guess, worker_tokenizer):
    # The verifiers loop busy for 1.5 s (a slow rubric, a busy machine): the episode's wait for
    # its next event sees an empty second and keeps waiting (up to wait_s), not an error.
    import time

    ids = _answer_ids(worker_tokenizer)
    episode = guess.start(guess.sample_task_at(np.random.default_rng(0), "t0", 0))
    try:
        async def busy():
            time.sleep(1.5)  # blocks the loop itself

        held = guess.loop().submit(busy())
        result = episode.step(ids)
        held.result(timeout=30)
        assert (result.done, result.termination, result.reward) == (True, "answered", 1.0)
    finally:
        episode.close()


def test_a_call_the_run_made_while_the_episode_closed_is_refused(guess):
    # A request that reached the endpoint for this episode's model just before close() (the run
    # went on before its cancellation landed) is answered 499, not left waiting for a turn.
    from envs.verifiers_endpoint import Call

    episode = guess.start(guess.sample_task_at(np.random.default_rng(0), "t0", 0))
    late = Call(model=episode.model, prompt_ids=list(episode.tokens), stop_token_ids=[], max_tokens=None)
    assert guess.endpoint.submit(late) is not None
    episode.close()
    assert late.wait(0) and (late.status, late.error) == (499, "the episode ended")


@pytest.fixture(scope="module")
def judged(worker_tokenizer):
    pytest.importorskip("verifiers.v1", reason="the verifiers extra is not installed")
    from envs.loading import make_env

    env = make_env("verifiers", worker_tokenizer, id="vf_judged", args={"high": 8, "turns": 2})
    yield env
    env.close()


def test_an_untrainable_trace_ahead_of_the_players_is_skipped_not_the_end_of_the_sum(judged,
                                                                                      worker_tokenizer):
    # vf_judged: the judge's untrainable trace (reward 5) finishes before the player's. The
    # episode's reward is the player's alone: 1 for naming draw 0's secret (4), never 5 or 6, and
    # never 0 (a loop that stopped at the first untrainable trace would miss the player's).
    from envs.rollout import run_episodes
    from mixrl_wire.sampling import SamplingParams

    generate, _ = _replying_four(worker_tokenizer)

    episode = judged.start(judged.sample_task_at(np.random.default_rng(0), "t0", 0))
    try:
        (rec,) = run_episodes(generate, [episode], SamplingParams(max_new_tokens=16, head_k=0),
                              max_total_tokens=512)
        traces = episode.result.traces
        assert [t.agent.trainable for t in traces] == [False, True], traces  # the judge's first
        assert rec.termination == "answered" and rec.reward == 1.0, rec
        assert episode.reward_parts == {"found": 1.0}
    finally:
        episode.close()
