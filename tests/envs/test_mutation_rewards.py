"""Reward-pool behaviour the reward modules' mutants showed untested (issue 37; docs/testing.md).

Real worker processes over their real pipes; each test a second or two."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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


def test_built_ins_run_under_the_pools_memory_limit():
    # 16 MiB of address space is far below what a worker has mapped: a call cannot allocate anew.
    # math's parser is bounded and small, so its answers still score; exact stripping a 20 MB reply
    # needs a 20 MB copy and scores 0 as memory (with the default 4 GiB it scores 0 as a mismatch).
    pool = RewardPool("math", workers=1, timeout_s=10, memory_bytes=16 << 20)
    try:
        symbolic = pool.score(completion="\\boxed{x^2+2x+1}", answer="(x+1)^2", prompt="", task={})
        cheap = pool.score(completion="\\boxed{3/4}", answer="0.75", prompt="", task={})
    finally:
        pool.close()
    assert (symbolic.reward, cheap.reward) == (1.0, 1.0), (symbolic, cheap)
    pool = RewardPool("exact", workers=1, timeout_s=10, memory_bytes=16 << 20)
    try:
        big = pool.score(completion=" " + "x" * (20 << 20), answer="x", prompt="", task={})
        small = pool.score(completion=" x ", answer="x", prompt="", task={})
    finally:
        pool.close()
    assert (big.reward, big.reason, small.reward) == (0.0, "memory", 1.0), (big, small)


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


def _worker_answers(request_file: Path) -> str:
    """What a reward worker answers to the requests in ``request_file`` (its stdin), then EOF."""
    with request_file.open("rb") as stdin:
        out = subprocess.run([sys.executable, "-m", "envs.rewards.worker"], stdin=stdin, capture_output=True,
                             cwd=Path(__file__).parents[2], timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.decode()


def test_a_request_line_past_64_mib_is_refused(tmp_path):
    # A 63 MiB line is answered and a 65.5 MiB one is refused: answered too_large (id null) after
    # the limit + 1 bytes, and the worker exits. (Was slow, 36 s, while the worker copied its
    # pending input at every read; the exact boundary: tests/envs/test_reward_requests.py.)
    def request(size: int) -> Path:
        path = tmp_path / f"request-{size}"
        head = b'{"id": 1, "check": "exact", "pad": "'
        with path.open("wb") as f:
            f.write(head + b"x" * (size - len(head) - 3) + b'"}\n')
        return path

    small = request(63 << 20)
    assert _worker_answers(small) == '{"id": 1, "ok": true, "value": null}\n'
    small.unlink()
    refused = json.loads(_worker_answers(request((65 << 20) + (1 << 19))))
    assert refused["id"] is None and refused["reason"] == "too_large", refused


_CAP_DRAIN = """
import fcntl, json, os, time
from envs.rewards import worker
sup = worker.Supervisor()
r, w = os.pipe()
fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ: room for the whole result at once
line = json.dumps({"nonce": "n0", "ok": True, "value": {"reward": 1.0, "metrics": {}}, "pad": ""}).encode()
line = line[:-2] + b"x" * (worker.MAX_RESULT_BYTES - len(line) - 1) + b'"}\\n'
assert len(line) == worker.MAX_RESULT_BYTES
os.write(w, line + b"more\\n")
os.close(w)
pid = os.fork()
if pid == 0:
    os._exit(0)
while open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] != "Z":
    time.sleep(0.01)
os.write(sup.channel_out, json.dumps(sup._collect(pid, r, 10.0, "n0")).encode())
"""


def test_a_valid_result_of_exactly_the_cap_with_more_behind_it_is_refused():
    # The call has ended (its pid is a zombie) with exactly MAX_RESULT_BYTES of a valid result frame
    # on the pipe and more behind it: the first read takes the frame, the exit is seen in the same
    # round, and the drain after it must still read on and refuse the lot (a drain that stopped at
    # exactly the cap scored the frame).
    # stdin stays open: the end of the worker's channel would mean the pool is gone
    proc = subprocess.Popen([sys.executable, "-c", _CAP_DRAIN], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=Path(__file__).parents[2])
    try:
        out, err = proc.stdout.read(), proc.stderr.read()
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    assert proc.returncode == 0, err.decode()[-2000:]
    answer = json.loads(out)
    assert answer["ok"] is False and answer["reason"] == "stray_output", answer


def test_a_reward_dict_of_one_key_over_the_metrics_limit_names_the_limit():
    """``reward`` plus MAX_METRICS metrics is the most a reward function may return; one key more is
    refused with the count and that limit (reward + metrics) named, as the docs give it."""
    from envs.rewards.limits import MAX_METRICS
    from envs.rewards.worker import normalise

    full = {"reward": 0.5, **{f"m{i}": float(i) for i in range(MAX_METRICS)}}
    assert normalise(full) == {"reward": 0.5, "metrics": {k: v for k, v in full.items() if k != "reward"}}
    with pytest.raises(ValueError, match=rf"^reward function returned a dict of {MAX_METRICS + 2} keys "
                                         rf"\(at most {MAX_METRICS + 1}\)$"):
        normalise({**full, "one_more": 1.0})
