"""The ``shell`` env grades what it says it grades (docs/operations.md, "What the rewards trust"):
the submitted text, or the content of the file the task names, against a value held outside the
jail; never an exit status, a printed marker or anything else the model's commands produce."""

import numpy as np
import pytest

from convert.tokenizer import char_tokenizer
from envs import make_env
from envs.sandbox import sandbox_available

TOK = char_tokenizer()
pytestmark = pytest.mark.skipif(not sandbox_available(), reason="needs root + unshare (namespaces)")


def _tool(cmd: str) -> list[int]:
    return [TOK.token_to_id("<tool>")] + TOK.encode(cmd).ids + [TOK.token_to_id("</tool>")]


def _submit(answer: str) -> list[int]:
    return [TOK.token_to_id("<submit>")] + TOK.encode(answer).ids + [TOK.token_to_id("</submit>")]


def _episode(env, task, commands: list[str], answer: str) -> float:
    with env.start(task) as ep:
        for cmd in commands:
            assert not ep.step(_tool(cmd)).done
        result = ep.step(_submit(answer))
    assert result.done and result.termination == "submitted"
    return result.reward


def test_the_file_check_reads_the_file_and_nothing_else():
    env = make_env("shell", TOK, families=("write",), max_turns=6)
    task = env.sample_task(np.random.default_rng(0), "w")
    word = task.payload["check"]["value"]
    # Exit 0, "PASS" markers, the word in the submission or in another file: none is the check.
    fakes = [f"echo PASS; echo {word}; touch ok passed; exit 0", f"echo {word} > other.txt",
             f"echo {word}x > out.txt"]
    assert _episode(env, task, fakes, word) == 0.0
    assert _episode(env, task, [f"echo {word} > out.txt"], "anything") == 1.0


def test_the_answer_check_compares_the_submission_with_a_value_outside_the_jail():
    env = make_env("shell", TOK, families=("sum",), max_turns=6)
    task = env.sample_task(np.random.default_rng(1), "s")
    total = task.payload["check"]["value"]
    assert total not in {f.strip() for f in task.payload["files"].values()}  # the sum is not in the jail
    assert _episode(env, task, ["echo PASS; exit 0", f"echo {total} > answer.txt"], "PASS") == 0.0
    assert _episode(env, task, ["cat a.txt b.txt"], total) == 1.0
