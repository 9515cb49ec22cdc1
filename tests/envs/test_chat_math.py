"""``chat_math`` (issue 30, item 4): arithmetic word problems for a model's own tokenizer, rendered
through its chat template, graded by the built-in ``math`` reward in the reward workers."""

from __future__ import annotations

import re

import numpy as np
import pytest

from convert.tokenizer import char_tokenizer, load_tokenizer
from envs import make_env
from envs.chat_math import SYSTEM_PROMPT


@pytest.fixture(scope="module")
def tokenizer(model_dir):  # tests/envs/conftest.py: a byte-level BPE with a ChatML-style template
    return load_tokenizer(model_dir)


def test_tasks_render_through_the_template_and_samplers_render_the_same(tokenizer):
    env = make_env("chat_math", tokenizer, difficulty=3)
    env.chat_template_kwargs = {"enable_thinking": False}
    rng = np.random.default_rng(0)
    tasks = [env.sample_task(rng, f"t{i}") for i in range(200)]
    sampler_env = make_env("chat_math", tokenizer, difficulty=1)  # built by name, default options
    for task in tasks[:20]:
        p = task.payload
        assert int(p["answer"]) == {"+": p["a"] + p["b"], "-": p["a"] - p["b"], "*": p["a"] * p["b"]}[p["op"]]
        assert p["a"] >= 100 and p["b"] >= 100 and int(p["answer"]) >= 0
        text = tokenizer.decode(env.start(task).prompt, skip_special_tokens=False)
        assert text.startswith(f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n")
        assert f"{p['question']}<|im_end|>\n<|im_start|>assistant\n<think>" in text
        # What a sampler building the environment by name sends the model: the trainer's prompt.
        assert sampler_env.start(task).prompt == env.start(task).prompt
    assert {t.payload["op"] for t in tasks} == {"+", "-", "*"}
    assert max(len(env.start(t).prompt) for t in tasks) <= env.longest_prompt()
    assert env.start(tasks[0]).stop_token_ids == (tokenizer.token_to_id("<|im_end|>"),
                                                  tokenizer.token_to_id("<|endoftext|>"))


def test_replies_are_graded_by_the_math_reward(tokenizer):
    env = make_env("chat_math", tokenizer, difficulty=2, reward_workers=1)
    try:
        task = env.sample_task(np.random.default_rng(3), "t")
        answer, stop = task.payload["answer"], tokenizer.token_to_id("<|im_end|>")

        def reply(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False).ids + [stop]

        assert env.score(task, reply(f"So it is \\boxed{{{answer}}}.")).reward == 1.0
        assert env.score(task, reply(f"\\boxed{{{int(answer) + 1}}}")).reward == 0.0
        assert env.score(task, reply(answer)).reward == 0.0  # no \boxed{}: no final answer
        ids, mask = env.demonstration(task)
        assert env.score(task, [t for t, m in zip(ids, mask, strict=True) if m]).reward == 1.0
        assert mask[: len(env.start(task).prompt)] == [0] * len(env.start(task).prompt)
    finally:
        env.close()


def test_character_tokenizer_fallback_and_the_refusal_it_replaces(tokenizer):
    env = make_env("chat_math", char_tokenizer())
    task = env.sample_task(np.random.default_rng(1), "t")
    episode = env.start(task)
    assert episode.prompt[0] == env.bos and episode.stop_token_ids == (env.eos,)
    assert env.longest_prompt() >= len(episode.prompt)
    assert re.search(r"\d+", task.payload["question"])
    # arithmetic cannot serve a model's tokenizer; its error names chat_math instead.
    with pytest.raises(ValueError, match="use env: chat_math"):
        make_env("arithmetic", tokenizer)
