import time
from pathlib import Path

import pytest

from envs.rewards import RewardPool, check_reward_spec
from envs.rewards.builtin import final_answer, math_reward
from envs.sandbox import sandbox_available

HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
def _user_module_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))  # the workers inherit the trainer's import path


def _kw(**over):
    return {"completion": "42", "answer": "42", "prompt": "hello", "task": {}} | over


def test_user_function_by_keyword_with_metrics_in_a_torch_free_worker():
    pool = RewardPool("user_rewards:length_bonus", workers=1, timeout_s=30)
    try:
        pool.check()
        r = pool.score(**_kw(completion=" 42"))
        assert r.reward == 1.0 and r.error is None
        # Numeric keys become metrics; text is dropped; the worker never loaded torch.
        assert r.metrics == {"chars": 3.0, "torch_loaded": 0.0, "saw_prompt": 1.0}
        assert pool.score(**_kw(completion="41")).reward == 0.0
    finally:
        pool.close()


def test_exceptions_timeouts_and_bad_returns_score_zero_and_the_pool_recovers(caplog):
    pool = RewardPool("user_rewards:raises", workers=1, timeout_s=30)
    try:
        with caplog.at_level("WARNING"):
            first, second = pool.score(**_kw()), pool.score(**_kw())
        assert first.reward == 0.0 and "boom from the user's code" in first.error and not first.timed_out
        assert second.error and sum("boom" in m for m in caplog.messages) == 1  # first message only
    finally:
        pool.close()
    pool = RewardPool("user_rewards:sleeps", workers=1, timeout_s=1.0)
    try:
        t0 = time.monotonic()
        r = pool.score(**_kw(task={"sleep": 60}))
        assert r.timed_out and r.reward == 0.0 and time.monotonic() - t0 < 10
        assert pool.score(**_kw(task={"sleep": 0})).reward == 1.0  # a fresh worker took over
    finally:
        pool.close()
    for spec, error in (("user_rewards:returns_text", "not a float"),
                        ("user_rewards:prints_then_scores", None)):
        pool = RewardPool(spec, workers=1, timeout_s=30)
        try:
            r = pool.score(**_kw())
            assert (r.error is None and r.reward == 0.5) if error is None else error in r.error
        finally:
            pool.close()


def test_bad_reward_names_fail_early_in_one_line():
    with pytest.raises(ValueError, match="built-in"):
        check_reward_spec("not a target")
    pool = RewardPool("user_rewards:missing", workers=1, timeout_s=30)
    try:
        with pytest.raises(ValueError, match="no function 'missing'"):
            pool.check()
    finally:
        pool.close()


@pytest.mark.parametrize("reply,answer,want", [
    ("so the total is \\boxed{72}.", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),
    ("first 3 then\n#### 1,000", "1000", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{\\frac{\\sqrt{8}}{2}}", "\\sqrt{2}", 1.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("\\boxed{71}", "#### 72", 0.0),
    ("72", "72", 0.0),  # no final-answer marker: not an answer
])
def test_math_reward(reply, answer, want):
    assert math_reward(completion=reply, answer=answer, prompt="", task={}) == want


def test_final_answer_takes_the_last_balanced_box():
    assert final_answer("\\boxed{1} then \\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"


@pytest.mark.skipif(not sandbox_available(), reason="needs root + unshare (namespaces)")
def test_code_reward_runs_the_rows_tests_in_the_sandbox():
    pool = RewardPool("code", workers=1, timeout_s=30)
    tests = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]
    try:
        good = "Here:\n```python\ndef add(a, b):\n    return a + b\n```"
        assert pool.score(**_kw(completion=good, answer=None, task={"tests": tests})).reward == 1.0
        wrong = "```python\ndef add(a, b):\n    return a - b\n```"
        assert pool.score(**_kw(completion=wrong, answer=None, task={"tests": tests})).reward == 0.0
        loop = "```python\nwhile True:\n    pass\n```"
        r = pool.score(**_kw(completion=loop, answer=None, task={"tests": tests}))
        assert r.reward == 0.0 and r.error is None  # the sandbox's limit, not the pool's timeout
    finally:
        pool.close()


def test_built_in_math_refuses_a_huge_power_at_once_and_the_worker_carries_on():
    # Before the parser of our own, this reply sent sympy into a huge expansion that only the call's
    # timeout ended; now the exponent is over the parser's bound: a plain 0 at once, no error.
    pool = RewardPool("math", workers=1, timeout_s=1.0)
    try:
        assert pool.score(**_kw(completion="\\boxed{72}", answer="#### 72")).reward == 1.0
        t0 = time.monotonic()
        r = pool.score(**_kw(completion="\\boxed{(x+1)^{99999}}", answer="3"))
        assert (r.reward, r.reason, r.timed_out) == (0.0, None, False) and time.monotonic() - t0 < 1.0
        assert pool.score(**_kw(completion="\\boxed{x^2+2x+1}", answer="(x+1)^2")).reward == 1.0
    finally:
        pool.close()
