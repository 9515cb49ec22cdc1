"""The verifiers bridge on single-token re-renders (issue 46), with the real ``verifiers`` 0.4
package, the multi-turn ``vf_guess`` env and mixrl's episode driver (``envs.rollout``).

A turn that ends with ``<|endoftext|>`` where the chat template closes a turn with
``<|im_end|>`` comes back re-rendered in the next call: the same tokens but the last. That call
does not extend the episode's tokens, so the episode must end ``bridge_miss``: accepting it (a
comparison one token short) trains a trajectory verifiers never saw. Each reply below is judged
against the reference rule, "the next call's prompt starts with every token so far", on the
prompt the real call carried (seen by wrapping the episode's own ``_next``, which still runs).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))  # vf_guess: the taskset id the tests name


pytest.importorskip("verifiers.v1", reason="the verifiers extra is not installed")


@pytest.fixture(scope="module")
def tok(worker_tokenizer):
    return worker_tokenizer  # tests/envs/conftest.py


@pytest.fixture(scope="module")
def guess(tok):
    from envs.loading import make_env

    env = make_env("verifiers", tok, id="vf_guess", args={"high": 8, "turns": 2})
    yield env
    env.close()


def _play(env, tok, reply: list[int]):
    """One episode whose every turn is ``reply``; (record, [(tokens so far, next prompt)])."""
    from envs.rollout import run_episodes
    from mixrl_wire.sampling import SamplingParams

    episode = env.start(env.sample_task_at(np.random.default_rng(0), "t1", 1))
    calls = []
    real_next = episode._next

    def seen():  # the episode's own wait for the next event, noting each call's prompt
        kind, value = real_next()
        if kind == "call":
            calls.append((list(episode.tokens), list(value.prompt_ids)))
        return kind, value

    episode._next = seen

    def generate(prompts, params):
        lps = [-0.1] * len(reply)
        return [SimpleNamespace(token_ids=reply, logprobs=lps, logprobs_full=lps, versions=[0] * len(reply),
                                head_ids=[], head_logprobs=[], support_ids=None, support_logprobs=None)
                for _ in prompts]

    params = SamplingParams(max_new_tokens=16, head_k=0)
    (rec,) = run_episodes(generate, [episode], params, max_total_tokens=512)
    episode.close()
    return rec, calls


def test_a_re_render_that_changes_only_the_last_token_is_a_bridge_miss(guess, tok):
    """Issue 46: the reply ends with ``<|endoftext|>``; the next prompt has ``<|im_end|>`` there."""
    eos, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    assert eos != im_end
    reply = tok.encode("4", add_special_tokens=False).ids + [eos]
    rec, calls = _play(guess, tok, reply)
    (before, prompt), = calls
    n = len(before)
    assert prompt[:n - 1] == before[:-1] and prompt[n - 1] == im_end and before[-1] == eos  # one token
    assert rec.termination == "error" and rec.reward == 0.0 and rec.errors == {"bridge_miss": 1}


@pytest.mark.parametrize("text,ends", [("4", "im_end"), ("4", "none"), ("4", "im_end_twice"),
                                       ("4\n", "im_end"), ("1", "eos")])
def test_the_bridge_is_the_prefix_rule_on_single_token_re_renders(guess, tok, text, ends):
    eos, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    tail = {"im_end": [im_end], "none": [], "im_end_twice": [im_end, im_end], "eos": [eos]}[ends]
    rec, calls = _play(guess, tok, tok.encode(text, add_special_tokens=False).ids + tail)
    assert calls, "the episode made no second call"
    before, prompt = calls[0]
    extends = prompt[:len(before)] == before
    if extends:
        assert "bridge_miss" not in rec.errors
        # the trajectory is the calls' tokens: the next prompt's extension went in unchanged
        assert rec.token_ids.tolist()[:len(prompt)] == prompt
    else:
        assert rec.termination == "error" and rec.errors == {"bridge_miss": 1}, (text, ends, rec.errors)
