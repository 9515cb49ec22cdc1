"""A round's episodes each get their own token budget (prompt + new tokens).

The sampler loop runs a round's environment tasks with the same sampling together; the budget
used to come from the first task's prompt alone, so a task whose prompt was longer by the new
tokens or more generated nothing: an empty trajectory the trainer refuses, re-leased again and
again (the shipped chat_math configs' evaluations stalled for minutes on it).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from tiny_models import char_engine

from convert.tokenizer import char_tokenizer
from envs import make_env
from mixrl_wire import pb
from sampler_torch.loop import SamplerLoop

TOK = char_tokenizer()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return char_engine(tmp_path_factory)


def test_episodes_of_a_round_get_their_own_prompt_budgets(engine):
    env = make_env("arithmetic", TOK, difficulty=4)
    rng = np.random.default_rng(0)
    tasks = sorted(((t, len(env.start(t).prompt)) for t in (env.sample_task(rng, str(i)) for i in range(64))),
                   key=lambda tn: tn[1])
    short, long = tasks[0], tasks[-1]
    assert long[1] - short[1] > 1, (short[1], long[1])  # more than the new tokens apart
    sampling = pb.SamplingParams(temperature=1.0, top_p=1.0, head_k=2, max_new_tokens=1)
    items = []
    for i, (task, _) in enumerate((short, long)):  # the shorter prompt first: the old budget's
        prompt = env.start(task).prompt
        msg = pb.Task(task_id=i, env="arithmetic", payload=json.dumps(task.payload).encode(),
                      prompt_ids=prompt, group_size=1, sampling=sampling)
        msg.sampling.seed = 11 + i
        items.append((msg, 0))
    loop = SamplerLoop(None, engine, tokenizer=TOK)
    out = loop._generate(items)
    for rec, (_, n) in zip(out, (short, long), strict=True):
        # Every task generated its one new token (the old shared budget left the longer none).
        assert len(rec["token_ids"]) == 1, (n, rec["token_ids"], rec["finish_reason"])
