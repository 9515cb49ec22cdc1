"""Spawned samplers that die are restarted with backoff and counted; a crash loop is given up.

Real processes (``sh`` standing in for ``mixrl-sample``: the policy is about processes, not about
what they run), killed with SIGKILL as the OOM killer would.
"""

import os
import signal
import time

from trainer_jax.config import RunConfig
from trainer_jax.samplers import LocalSamplers

SERVE = ["sh", "-c", "echo up; exec sleep 60"]


def _until(samplers: LocalSamplers, restarts: int, timeout_s: float = 30.0) -> list[str]:
    events, deadline = [], time.monotonic() + timeout_s
    while samplers.restarts < restarts:
        assert time.monotonic() < deadline, events
        events += samplers.restart_dead()
        time.sleep(0.02)
    return events


def _wait_log(path, text: str, count: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and path.read_text().count(text) >= count):
        assert time.monotonic() < deadline, path.read_text() if path.exists() else path
        time.sleep(0.02)


def _kill(p) -> None:
    os.kill(p.pid, signal.SIGKILL)
    p.wait()


def test_a_killed_sampler_is_restarted_with_backoff_and_counted(tmp_path):
    s = LocalSamplers(RunConfig(), tmp_path, backoff_s=0.2, healthy_s=30, max_quick_deaths=2)
    first = s.launch("bf16-0", SERVE)
    s.launch("bf16-1", SERVE)
    try:
        assert s.restart_dead() == [] and s.restarts == 0
        _kill(first)
        t0 = time.monotonic()
        assert s.restart_dead() == ["sampler bf16-0 exited (code -9); restarting it in 0.2s"]
        assert s.restarts == 0 and not s.all_dead()  # not before its backoff
        assert _until(s, 1)[-1] == "sampler bf16-0 restarted (1 sampler restarts this run)"
        assert time.monotonic() - t0 >= 0.2
        second = s.processes[0]
        assert second.pid != first.pid and second.poll() is None and s.processes[1].poll() is None

        # Its "up" first: killed before its shell echoed, the second life would leave the log one
        # "up" short of the three lives counted below (CI, under load).
        _wait_log(tmp_path / "logs" / "bf16-0.log", "up", 2)
        _kill(second)  # dies again within healthy_s of its start: the backoff doubles
        t0 = time.monotonic()
        events = _until(s, 2)
        assert events[0] == "sampler bf16-0 exited (code -9); restarting it in 0.4s"
        assert time.monotonic() - t0 >= 0.4 and s.processes[0].poll() is None

        _wait_log(tmp_path / "logs" / "bf16-0.log", "up", 3)  # the third life is up: kill it after
        _kill(s.processes[0])  # a third quick death: given up, the other slot serves on
        assert "not restarting it" in s.restart_dead()[0]
        assert s.restarts == 2 and not s.all_dead()
        _kill(s.processes[1])
        s.restart_dead()
        assert not s.all_dead()  # bf16-1 restarts: one death is no crash loop
        _until(s, 3)
        assert s.processes[1].poll() is None
        # Each life of bf16-0 wrote to the same log.
        assert (tmp_path / "logs" / "bf16-0.log").read_text().count("up") == 3
    finally:
        s.stop(grace_s=2)
    assert s.restart_dead() == [] and s.all_dead()  # stopped: nothing comes back


def test_a_sampler_that_cannot_start_is_given_up_and_all_dead_says_so(tmp_path):
    s = LocalSamplers(RunConfig(), tmp_path, backoff_s=0.01, healthy_s=30, max_quick_deaths=3)
    s.launch("bf16-0", ["sh", "-c", "echo no model; exit 3"])
    events, deadline = [], time.monotonic() + 10
    while not s.all_dead():
        assert time.monotonic() < deadline, events
        events += s.restart_dead()
        time.sleep(0.01)
    assert s.restarts == 3 and events[-1].startswith("sampler bf16-0 exited (code 3) 4 times in a row")
    assert (tmp_path / "logs" / "bf16-0.log").read_text().count("no model") == 4


def test_each_spawned_sampler_has_its_slot_and_not_the_trainers_rank(tmp_path, monkeypatch):
    """The child's environment: MIXRL_SAMPLER_SLOT by launch order (kept across a restart), the
    trainer's LOCAL_RANK / SLURM_LOCALID removed (device auto then spreads over the GPUs)."""
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("SLURM_LOCALID", "3")
    samplers = LocalSamplers(RunConfig(), tmp_path)
    show = ["sh", "-c",
            'echo "slot=$MIXRL_SAMPLER_SLOT rank=${LOCAL_RANK:-}${SLURM_LOCALID:-}"; exec sleep 60']
    try:
        first, _ = samplers.launch("a-0", show), samplers.launch("b-0", show)
        _wait_log(tmp_path / "logs" / "a-0.log", "slot=", 1)
        _kill(first)
        _until(samplers, 1)
        _wait_log(tmp_path / "logs" / "a-0.log", "slot=", 2)
        assert (tmp_path / "logs" / "a-0.log").read_text().splitlines() == ["slot=0 rank=", "slot=0 rank="]
        _wait_log(tmp_path / "logs" / "b-0.log", "slot=", 1)
        assert (tmp_path / "logs" / "b-0.log").read_text().splitlines() == ["slot=1 rank="]
    finally:
        samplers.stop(grace_s=1)
