"""Reward-pool behaviour the reward modules' mutants showed untested (issue 37; docs/testing.md).

Real worker processes over their real pipes; each test a second or two."""

from __future__ import annotations

import os
import signal
import time

import pytest

from envs.rewards import RewardPool
from envs.rewards.code_harness import _DEPTH, decode


@pytest.mark.timeout(60)
def test_a_large_completion_is_scored_quickly_and_exactly():
    # The worker reads its requests in 1 MiB reads: a 300 KB completion is a handful of reads.
    # Read byte by byte (a mutant of that read), a 600 KB request took over 10 minutes: its line is
    # searched and copied again after every byte, and the pool's write of the request waits for it
    # (the call's timeout does not cover the write).
    pool = RewardPool("exact", workers=1, timeout_s=5)
    try:
        pool.check()
        text = "x" * 300_000
        t0 = time.monotonic()
        right = pool.score(completion=text, answer=text, prompt="", task={})
        wrong = pool.score(completion=text + "y", answer=text, prompt="", task={})
        took = time.monotonic() - t0
    finally:
        pool.close()
    assert right.reward == 1.0 and right.error is None, right
    assert wrong.reward == 0.0 and wrong.error is None, wrong
    assert took < 5.0, took


def test_an_inline_built_in_runs_under_the_pools_memory_limit():
    # math runs inline in the worker (no fork): the pool's limit is set around the call. Under
    # 16 MiB of address space (far below what the worker has mapped) the symbolic comparison
    # cannot allocate and scores 0 (with the default 4 GiB it scores 1: test_rewards), a cheap
    # exact fraction still scores 1.
    pool = RewardPool("math", workers=1, timeout_s=10, memory_bytes=16 << 20)
    try:
        symbolic = pool.score(completion="\\boxed{x^2+2x+1}", answer="(x+1)^2", prompt="", task={})
        cheap = pool.score(completion="\\boxed{3/4}", answer="0.75", prompt="", task={})
    finally:
        pool.close()
    assert (symbolic.reward, cheap.reward) == (0.0, 1.0), (symbolic, cheap)


def test_a_stopped_worker_is_killed_at_the_calls_timeout_plus_grace_and_replaced(monkeypatch):
    # The worker enforces a call's timeout itself; the pool's own deadline (timeout + grace) is for
    # a worker that stops answering: the call scores 0 as a timeout and the next call gets a new one.
    import envs.rewards as rewards

    monkeypatch.setattr(rewards, "_GRACE_S", 0.5)
    pool = RewardPool("exact", workers=1, timeout_s=0.5)
    try:
        pool.check()
        (worker,) = pool._all
        os.kill(worker.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        stuck = pool.score(completion="a", answer="a", prompt="", task={})
        took = time.monotonic() - t0
        after = pool.score(completion="a", answer="a", prompt="", task={})
        assert worker.proc.poll() is not None and worker not in pool._all
    finally:
        pool.close()
    assert stuck.reward == 0.0 and stuck.timed_out and stuck.reason == "timeout", stuck
    assert stuck.error.startswith("timeout after ") and stuck.error.endswith(" s (worker killed)"), stuck
    assert 0.9 < took < 30 and float(stuck.error.split()[2]) >= 0.9, (took, stuck.error)
    assert after.reward == 1.0 and after.error is None, after


def test_nested_results_deeper_than_the_limit_are_refused():
    nested: list = []
    for _ in range(_DEPTH + 5):
        nested = [nested]
    with pytest.raises(ValueError, match="nested too deeply"):
        decode(nested)
    ok: list = [7]
    for _ in range(_DEPTH - 1):
        ok = [ok]
    assert decode(ok) == ok
    deep_dict = {"$": "tuple", "v": [nested]}
    with pytest.raises(ValueError, match="nested too deeply"):
        decode(deep_dict)
