"""``chain``: long single-turn replies (>= 40 policy tokens), exactly scored, with demonstrations."""

import numpy as np
import pytest

from convert.tokenizer import char_tokenizer
from envs import make_env
from envs.long_tasks import chain

TOK = char_tokenizer()


def test_chain_writes_every_intermediate_result():
    assert chain([7, 3, 5, 8], ["+", "-", "+"]) == "7+3=10,10-5=5,5+8=13"
    assert chain([1, 4], ["-"]) == "1-4=-3"


@pytest.mark.parametrize("difficulty", [1, 3])
def test_demonstrations_are_long_and_score_one_and_a_wrong_step_scores_zero(difficulty):
    env = make_env("chain", TOK, difficulty=difficulty)
    steps = make_env("chain", TOK, difficulty=difficulty, scoring="steps")
    prefix = make_env("chain", TOK, difficulty=difficulty, scoring="prefix")
    rng = np.random.default_rng(0)
    lengths = []
    for i in range(30):
        task = env.sample_task(rng, f"t{i}")
        ids, mask = env.demonstration(task)
        with env.start(task) as ep:
            reply = ids[len(ep.prompt):]
            assert sum(mask) == len(reply) and env.score(task, reply) == 1.0
        lengths.append(len(reply))
        text = env.decode(reply[:-1])
        first, rest = text.split(",", 1)
        a, result = first.split("=")
        wrong = env.encode(f"{a}={int(result) + 1},{rest}") + [env.eos]  # one step off
        assert env.score(task, wrong) == 0.0
        n = text.count(",") + 1
        assert steps.score(task, wrong) == pytest.approx((n - 1) / n)
        assert steps.score(task, reply) == 1.0
        assert steps.score(task, reply[:-1]) == 0.0  # no <eos>: cut by the length limit
        assert prefix.score(task, reply) == 1.0 and prefix.score(task, reply[:-1]) == 0.0
        assert 0 < prefix.score(task, wrong) < 0.2  # a wrong first step costs everything after it
        half = reply[: len(reply) // 2] + [env.eos]
        assert prefix.score(task, half) == pytest.approx((len(reply) // 2) / len(text))
    assert min(lengths) >= 40


def test_bad_options_fail_when_built():
    with pytest.raises(ValueError, match="scoring"):
        make_env("chain", TOK, scoring="fuzzy")
