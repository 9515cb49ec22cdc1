"""Reward functions that fork, write to stray descriptors, crash, exit, allocate, return junk or leave
processes behind: each call scores 0 with its reason, the next call's reward lands on its own
completion, and nothing the function started outlives the call or the pool.

One real pool (``envs.rewards.RewardPool``, real worker processes) serves every case; the function
(``hostile_rewards:hostile``) does what the row's ``do`` says."""

import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from reward_procs import scratch_dir, wait_dead

from envs.rewards import RewardPool
from trainer_jax.service.tasks import RewardLedger

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def pool():
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(HERE))  # the workers inherit the trainer's import path
    pool = RewardPool("hostile_rewards:hostile", workers=1, timeout_s=2.0, memory_bytes=1024**3)
    try:
        pool.check()
        yield pool
    finally:
        pool.close()
        mp.undo()


@pytest.fixture
def shared_dir():
    """A directory every uid can write (calls run under uids of their own as root)."""
    yield from scratch_dir("mixrl-reward-test-", 0o1777)


def _score(pool, **task):
    return pool.score(completion="x", answer=None, prompt="p", task=task)




def test_a_reward_that_forks_scores_zero_and_later_rewards_land_on_their_own_completions(pool):
    results = [_score(pool, do="forks", r=0.1), _score(pool, r=0.9), _score(pool, r=0.5), _score(pool, r=0.7)]
    # Before: the forked copy kept serving requests: [0.1, 0.1, 0.9, 0.9].
    assert [r.reward for r in results] == [0.0, 0.9, 0.5, 0.7]
    assert results[0].reason == "forked" and "forked" in results[0].error
    assert all(r.reason is None for r in results[1:])


def test_writes_to_every_descriptor_cannot_forge_a_reward(pool):
    results = [_score(pool, do="writes_everywhere", r=0.1), _score(pool, r=0.5), _score(pool, r=0.7)]
    # Before: a forged answer on the worker's inherited channel scored 1e6.
    assert [r.reward for r in results] == [0.0, 0.5, 0.7]
    assert results[0].reason == "stray_output"


@pytest.mark.parametrize("task,reason", [
    ({"do": "segfaults"}, "crashed"),
    ({"do": "exits"}, "exited"),
    ({"do": "allocates", "bytes": 20 * 1024**3}, "memory"),  # 20 GB against the 1 GiB limit
    ({"do": "returns", "kind": "nan"}, "out_of_range"),
    ({"do": "returns", "kind": "text"}, "bad_return"),
    ({"do": "returns", "kind": "huge"}, "bad_return"),
    ({"do": "returns", "kind": "bool"}, "bad_return"),
    ({"do": "returns", "kind": "no_reward"}, "bad_return"),
])
def test_each_failure_scores_zero_with_its_reason_and_the_pool_recovers(pool, task, reason):
    bad = _score(pool, r=1.0, **task)
    assert (bad.reward, bad.reason) == (0.0, reason), bad
    assert bad.error and not bad.timed_out
    assert _score(pool, r=0.25).reward == 0.25
    assert _score(pool, do="allocates", bytes=10 * 1024**2, r=0.5).reward == 0.5  # within the limit


def test_processes_a_call_starts_die_with_the_call(pool, shared_dir):
    pids_file = shared_dir / "pids"
    r = _score(pool, do="leaves_children", r=0.75, pids_file=str(pids_file))
    assert r.reward == 0.75 and r.reason is None
    pids = [int(p) for p in pids_file.read_text().split()]
    assert len(pids) == 2 and wait_dead(pids) == []  # a setsid'd child and a double-forked daemon
    # The same after a timeout: the call, its child and its daemon are all killed.
    t0 = time.monotonic()
    r = _score(pool, do="leaves_children", hang=True, r=1.0, pids_file=str(pids_file))
    assert r.timed_out and r.reason == "timeout" and time.monotonic() - t0 < 6
    assert wait_dead([int(p) for p in pids_file.read_text().split()]) == []
    assert _score(pool, r=0.5).reward == 0.5  # the same worker serves on: no re-import
    # A call past its timeout is asked to stop first: its finally blocks (a sandbox's close()) run.
    r = _score(pool, do="cleans_up", marker=str(shared_dir / "closed"))
    assert r.reason == "timeout" and (shared_dir / "closed").read_text() == "closed"


def test_closing_the_pool_kills_a_running_call_and_everything_it_started(shared_dir, monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    pool = RewardPool("hostile_rewards:hostile", workers=1, timeout_s=60)
    pids_file = shared_dir / "pids"
    done = {}
    thread = threading.Thread(target=lambda: done.update(r=_score(
        pool, do="leaves_children", hang=True, r=1.0, pids_file=str(pids_file))))
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not (pids_file.exists() and len(pids_file.read_text().split()) == 2):
            assert time.monotonic() < deadline, "the call never started its children"
            time.sleep(0.05)
        worker_pids = [w.proc.pid for w in pool._all]
    finally:
        pool.close()
    thread.join(10)
    assert done["r"].reward == 0.0 and done["r"].reason == "worker_died"
    assert wait_dead([*map(int, pids_file.read_text().split()), *worker_pids]) == []
    assert os.path.exists(pids_file)


def test_failures_reach_the_step_metrics_by_reason(pool):
    results = [_score(pool, do="forks", r=0.1), _score(pool, do="segfaults"), _score(pool, do="forks", r=0.1),
               _score(pool, r=0.5)]
    ledger = RewardLedger()
    trajs = [SimpleNamespace(task_id=1, sample_index=i, group="g") for i in range(len(results))]
    for t, r in zip(trajs, results, strict=True):
        ledger.put((1, t.sample_index), r)
    m = ledger.metrics(trajs)
    assert m["reward/errors/forked"] == 2 and m["reward/errors/crashed"] == 1 and m["reward_errors"] == 3
    assert not any(k.startswith("reward/errors/") for k in ledger.metrics(trajs))  # read once
