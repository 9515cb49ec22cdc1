"""Multi-turn episodes driven through the real engine keep an exact, aligned behaviour record."""

import numpy as np
import pytest
from tiny_models import char_engine

from convert.tokenizer import char_tokenizer
from envs import make_env
from envs.rollout import run_episodes
from envs.sandbox import sandbox_available
from sampler_torch.engine import SamplingParams

TOK = char_tokenizer()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return char_engine(tmp_path_factory)


def _check(rec, prompt, budget, head_k):
    assert len(rec.token_ids) == len(rec.loss_mask) <= budget
    assert list(rec.token_ids[: len(prompt)]) == list(prompt) and not rec.loss_mask[: len(prompt)].any()
    p = int(rec.loss_mask.sum())
    assert rec.logprobs.shape == rec.logprobs_full.shape == rec.versions.shape == (p,)
    assert rec.head_ids.shape == rec.head_logprobs.shape == (p, head_k)
    assert len(rec.support_indptr) == p + 1
    assert rec.loss_mask[-1] == 1  # never ends on an observation: a policy token closes the record
    assert np.all(rec.logprobs <= 1e-6)


def test_single_turn_episodes(engine):
    env = make_env("arithmetic", TOK)
    rng = np.random.default_rng(0)
    episodes = [env.start(env.sample_task(rng, str(i))) for i in range(6)]
    params = SamplingParams(temperature=1.0, top_p=0.9, head_k=4, max_new_tokens=5)
    records = run_episodes(engine.generate, episodes, params, max_total_tokens=40, seeds=list(range(6)))
    for ep, rec in zip(episodes, records, strict=True):
        _check(rec, ep.prompt, 40, 4)
        assert rec.turns == 1 and rec.termination in {"answered", "length", "empty_reply"}
        assert rec.support_indptr[-1] > 0  # top-p active: every token carries its kept set
    # The same seeds give the same episodes.
    replay = run_episodes(engine.generate, [env.start(env.sample_task(np.random.default_rng(0), "x"))],
                          params, max_total_tokens=40, seeds=[0])
    assert list(replay[0].token_ids) == list(records[0].token_ids)


@pytest.mark.skipif(not sandbox_available(), reason="needs root + unshare (namespaces)")
def test_tool_episodes_end_within_budget_without_trailing_observation(engine):
    env = make_env("shell", TOK, max_turns=6)
    rng = np.random.default_rng(1)
    episodes = [env.start(env.sample_task(rng, str(i))) for i in range(4)]
    params = SamplingParams(temperature=1.0, head_k=3, max_new_tokens=12)
    try:
        records = run_episodes(engine.generate, episodes, params, max_total_tokens=48, seeds=[5, 6, 7, 8])
    finally:
        for ep in episodes:
            ep.close()
    for ep, rec in zip(episodes, records, strict=True):
        _check(rec, ep.prompt, 48, 3)
        assert rec.termination in {"submitted", "turn_limit", "toolless_stop", "empty_reply", "length"}
        if rec.turns > 1:  # later turns follow environment tokens, which are masked out
            assert (rec.loss_mask[len(ep.prompt):] == 0).any()
