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

    tok = worker_tokenizer
    ids = tok.encode("4", add_special_tokens=False).ids + [tok.token_to_id("<|im_end|>")]

    def generate(prompts, params):
        return [SimpleNamespace(token_ids=ids, logprobs=[-0.1] * len(ids), logprobs_full=[-0.1] * len(ids),
                                versions=[0] * len(ids), head_ids=[], head_logprobs=[], support_ids=None,
                                support_logprobs=None) for _ in prompts]

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
