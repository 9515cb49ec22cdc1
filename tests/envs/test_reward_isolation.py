"""A reward call reaches nothing but its own answer (issue 44 items 3 and 4, the pool's side).

Real pools (``RewardPool(spec, workers=, timeout_s=, memory_bytes=)``, real worker processes, real
uids and cgroups) score ``hostile_rewards:hostile`` rows whose call attacks its isolation
(``tests/envs/hostile_attacks.py``). Each test asserts the attempt failed *and* its effect is
absent: the next rewards land on their own completions, the trainer and the workers are alive,
no file, segment or process is left. Attacks that need root and a cgroup skip elsewhere with the
pool's own warning line as the reason (CI runs as root)."""

from __future__ import annotations

import errno
import logging
import os
import signal
import stat
import threading
import time
from pathlib import Path

import pytest
from reward_procs import alive, scratch_dir, wait_dead

import envs.rewards as rewards
from envs.jail.uids import uid_processes
from envs.rewards import RewardPool, call_isolation
from envs.rewards.call_isolation import CALL_MAX_PIDS, ISOLATION_ENV, Plan, describe_gaps, plan
from envs.rewards.worker import builtin_environment

HERE = Path(__file__).parent
PLAN = plan()
FULL = PLAN.uid and PLAN.cgroup and PLAN.namespaces
needs_full = pytest.mark.skipif(not FULL, reason=f"needs root and a memory+pids cgroup ({PLAN.warning()})")
MiB, GiB = 1 << 20, 1 << 30
DENIED = (errno.EPERM, errno.EACCES)


@pytest.fixture(scope="module")
def shared():
    """For pid files: any uid writes there, like /tmp."""
    yield from scratch_dir("mixrl-reward-isolation-", 0o1777)


@pytest.fixture(scope="module")
def trainer_cwd():
    """The trainer's working directory: root's, open to read (0755), like a checkout."""
    yield from scratch_dir("mixrl-trainer-cwd-", 0o755)


@pytest.fixture(scope="module")
def pool(trainer_cwd):
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(HERE))
    mp.chdir(trainer_cwd)  # the workers start here: the calls inherit it
    # Metrics here carry uids (1.6e9) and pids: a bound far above them.
    pool = RewardPool("hostile_rewards:hostile", workers=2, timeout_s=10.0, memory_bytes=256 * MiB,
                      max_abs_reward=1e12)
    try:
        pool.check()
        yield pool
    finally:
        pool.close()
        mp.undo()


def _score(pool, **task):
    return pool.score(completion="x", answer=None, prompt="p", task=task)


def _attack(pool, what, **task):
    return _score(pool, do="attack", what=what, trainer=os.getpid(), **task)


def _workers(pool) -> list[int]:
    return sorted(w.proc.pid for w in pool._all)


def _then_own_rewards(pool) -> None:
    """The next three calls score exactly their own rewards (none forged, none shifted)."""
    assert [_score(pool, r=r).reward for r in (0.11, 0.22, 0.33)] == [0.11, 0.22, 0.33]


@needs_full
def test_the_proc_fd_channel_hijack_reaches_no_channel(pool):
    # Before: the call opened /proc/<supervisor>/fd/<channel> and the next three rewards were 0.777.
    r = _attack(pool, "hijack", r=0.5)
    assert r.reward == 0.5 and r.reason is None, r
    assert r.metrics["opened"] == 0 and r.metrics["denied"] >= 2  # the supervisor's and the trainer's fd dirs
    _then_own_rewards(pool)


def test_without_a_uid_the_hijack_still_cannot_forge_an_answer(monkeypatch, caplog):
    """The fallback (forced here): the supervisor is not dumpable and each request carries a nonce
    that a forged answer cannot know; the warning names what is not enforced."""
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.setenv(ISOLATION_ENV, "fork")
    monkeypatch.setattr(rewards, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="envs.rewards"):
        pool = RewardPool("hostile_rewards:hostile", workers=1, timeout_s=10.0)
    lines = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("reward calls:")]
    assert len(lines) == 1 and "\n" not in lines[0]
    for missing in ("no per-call uid (MIXRL_REWARD_ISOLATION=fork)", "no cgroup memory limit",
                    "shmem and memfd are not counted", "no private /dev/shm"):
        assert missing in lines[0], lines[0]
    try:
        # Only its own supervisor: running as the trainer's user (root here), the call can open the
        # trainer's descriptors too, other pools' channels included (the warning says so).
        r = _attack(pool, "hijack", r=0.5, supervisor_only=True)
        assert r.reward in (0.0, 0.5) and r.reward != 0.777, r  # its own call may fail, never score 0.777
        _then_own_rewards(pool)
    finally:
        pool.close()


def test_not_root_names_every_part(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    p = plan()
    assert (p.uid, p.cgroup, p.namespaces) == (False, False, False)
    line = p.warning()
    assert line.count("(not root: uid 1000)") == 3 and "can signal the trainer" in line, line


@pytest.mark.skipif(os.geteuid() != 0, reason="the probe runs only as root")
def test_root_that_cannot_unshare_keeps_the_uid_only_where_the_interpreter_is_open(monkeypatch):
    """Root in a container without CAP_SYS_ADMIN: no namespaces (named); the uid stays only if a
    call could still reach the interpreter without the mount namespace's covers."""
    monkeypatch.setattr(call_isolation, "_probe", lambda: (False, True))
    monkeypatch.setattr(call_isolation, "covers", lambda paths: [("/root", [".pyenv"])])
    closed = plan()
    assert (closed.uid, closed.namespaces) == (False, False)
    assert "unshare of a mount and IPC namespace refused" in closed.warning()
    assert "interpreter's directories are closed to others" in closed.warning()
    monkeypatch.setattr(call_isolation, "covers", lambda paths: [])
    open_ = plan()
    assert (open_.uid, open_.namespaces) == (True, False) and "per-call uid" not in open_.warning()


def test_root_without_a_cgroup_names_only_the_cgroup():
    gaps = describe_gaps(uid=None, cgroup="no writable cgroup", namespaces=None)
    line = Plan(True, False, True, gaps).warning()
    assert line.startswith("reward calls: no cgroup memory limit (no writable cgroup): shmem and memfd")
    assert "uid" not in line and "/dev/shm" not in line
    assert Plan(True, True, True).warning() is None


@needs_full
def test_a_working_directory_closed_to_the_calls_is_named_at_start(tmp_path, monkeypatch, caplog):
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    monkeypatch.chdir(closed)
    monkeypatch.setattr(rewards, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="envs.rewards"):
        RewardPool("math").close()  # no worker is started
    (line,) = [rec.getMessage() for rec in caplog.records]
    assert "cannot read" in line and str(closed) in line and "import at module level" in line


def test_the_isolation_mode_is_checked_in_one_line(monkeypatch):
    monkeypatch.setenv(ISOLATION_ENV, "none")
    with pytest.raises(ValueError, match=r"^MIXRL_REWARD_ISOLATION='none': give one of full, fork$"):
        RewardPool("math")


@needs_full
@pytest.mark.parametrize("what", ["shm_fill", "memfd_fill", "child_eats_memory"])
def test_a_gib_of_shared_memory_under_256_mib_is_a_memory_failure(pool, what):
    # Before: 1 GiB in /dev/shm or a memfd under memory_bytes = 256 MiB scored normally (RLIMIT_AS
    # does not count them) and the /dev/shm file outlived the call.
    name = f"mixrl-hostile-{os.getpid()}-{what}"
    r = _attack(pool, what, name=name, bytes=GiB, r=1.0)
    assert r.reward == 0.0 and r.reason in ("memory", "crashed"), r
    assert not os.path.exists(f"/dev/shm/{name}")
    fits = _attack(pool, "shm_fill", name=name, bytes=64 * MiB, r=0.75)  # the limit is the one given
    assert (fits.reward, fits.reason) == (0.75, None), fits
    assert not os.path.exists(f"/dev/shm/{name}")


@needs_full
def test_a_call_signals_neither_the_trainer_nor_the_workers(pool):
    before = _workers(pool)
    r = _attack(pool, "kill_everyone", r=0.5)
    assert r.reward == 0.5 and r.metrics["targets"] >= 2 and r.metrics["killed"] == 0, r
    assert r.metrics["errno"] == errno.EPERM
    assert _workers(pool) == before and all(map(alive, before))
    # kill(-1, SIGKILL) reaches the processes of the call's own uid but itself: none.
    r = _attack(pool, "kill_all_visible", r=0.5)
    assert (r.reward, r.reason) == (0.5, None), r
    assert _workers(pool) == before
    _then_own_rewards(pool)


@needs_full
def test_no_ptrace_no_memory_no_environ_of_the_supervisor_or_the_trainer(pool):
    r = _attack(pool, "ptrace_supervisor", r=0.5)
    assert r.reward == 0.5, r
    for key in ("ptrace_attach", "ptrace_seize", "mem", "environ", "trainer_environ", "vm_readv"):
        assert r.metrics[key] in DENIED + (errno.ESRCH,), (key, r.metrics)


@needs_full
def test_no_root_no_trainer_cwd_no_lock_files_no_mounts_no_cgroup_moves(pool, trainer_cwd):
    r = _attack(pool, "become_root", r=0.5)
    assert r.metrics["setuid"] == errno.EPERM and r.metrics["setgid"] == errno.EPERM, r
    assert r.metrics["uid"] not in (0, os.getuid()) and r.metrics["gid"] == r.metrics["uid"]
    assert r.metrics["groups"] == 0
    r = _attack(pool, "write_trainer_cwd", r=0.5)
    assert r.metrics["relative"] in DENIED and r.metrics["via_proc"] in DENIED, r
    assert list(trainer_cwd.iterdir()) == []
    r = _attack(pool, "lock_files", r=0.5)
    assert r.metrics["errno"] in DENIED and r.metrics["own"] in DENIED, r
    r = _attack(pool, "mount_things", r=0.5)
    assert r.metrics["errno"] == errno.EPERM and r.metrics["shm"] == errno.EPERM, r
    r = _attack(pool, "cgroup_escape", r=0.5)
    assert r.metrics["moved"] == 0 and r.metrics["raised"] == 0, r


@needs_full
def test_dev_shm_is_the_calls_own(pool, shared):
    name = f"mixrl-secret-{os.getpid()}"
    # One worker, one call after another; then two workers at once.
    assert _attack(pool, "shm_write", name=name).reason is None
    r = _attack(pool, "shm_read", name=name)
    assert r.metrics["errno"] == errno.ENOENT and r.metrics["entries"] == 0, r
    hold = shared / "release-writer"
    writer = threading.Thread(target=_attack, args=(pool, "shm_write"),
                              kwargs=dict(name=name, hold_until=str(hold)))
    writer.start()
    try:
        time.sleep(0.3)
        r = _attack(pool, "shm_read", name=name)
        assert r.metrics["errno"] == errno.ENOENT, r
    finally:
        hold.touch()
        writer.join(30)
    assert not os.path.exists(f"/dev/shm/{name}")


@needs_full
def test_a_call_cannot_reach_a_call_of_another_worker(pool, shared):
    peer, done = shared / "peer", shared / "peer-done"
    waiter = threading.Thread(target=_attack, args=(pool, "wait_as_peer"),
                              kwargs=dict(peer_file=str(peer), done_file=str(done)))
    waiter.start()
    try:
        r = _attack(pool, "peek_other_call", peer_file=str(peer), r=0.5)
    finally:
        done.touch()
        waiter.join(30)
    assert r.reward == 0.5 and r.metrics["same_uid"] == 0, r
    for key in ("mem", "environ", "fds", "kill"):
        assert r.metrics[key] in DENIED, (key, r.metrics)


@needs_full
def test_what_a_call_starts_ends_with_it(pool, shared):
    # A setsid'd grandchild that clears its death signal and ignores SIGTERM/SIGHUP.
    pids_file = shared / "linger"
    r = _attack(pool, "escape_and_linger", pids_file=str(pids_file), r=0.5)
    assert r.reward == 0.5, r
    grandchild = int(pids_file.read_text().split()[0])
    assert wait_dead([grandchild]) == []
    # A child in a user and pid namespace of its own.
    ns_file = shared / "ns"
    r = _attack(pool, "namespace_escape", pids_file=str(ns_file), r=0.5)
    assert r.reward == 0.5 and r.metrics["lingering"] >= 1, r
    assert wait_dead([int(p) for p in ns_file.read_text().split()]) == []
    # A bomb of tasks stops at the cgroup's pids.max; the next call forks and scores normally.
    r = _attack(pool, "thread_bomb", r=0.5)
    assert r.reward == 0.5 and CALL_MAX_PIDS - 10 < r.metrics["started"] < CALL_MAX_PIDS, r
    # A SysV segment (never removed) dies with the call's IPC namespace.
    key = 0x6D78_0000 + os.getpid() % 0xFFFF
    r = _attack(pool, "sysv_segment", key=key, r=0.5)
    assert r.metrics["errno"] == 0, r
    segments = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    assert not [s for s in segments if int(s.split()[0]) == key]
    _then_own_rewards(pool)


@needs_full
def test_a_frame_without_the_calls_nonce_is_stray_output(pool):
    r = _attack(pool, "forge_own_frame", r=1.0)
    assert (r.reward, r.reason) == (0.0, "stray_output"), r
    assert "nonce" in r.error


@needs_full
def test_the_call_runs_python_and_imports_lazily_as_its_uid(pool):
    r = _attack(pool, "home", r=0.5)
    assert r.metrics["lazy_import"] == 1 and r.metrics["python_ran"] == 1, r
    assert r.metrics["supervisor_fds"] == 0
    home = os.path.expanduser("~root")
    if not os.stat(home).st_mode & stat.S_IXOTH:  # a home closed to others (pyenv or conda under /root)
        # Only what the interpreter needs is there; the rest of the home is not.
        assert r.metrics["home_entries"] <= 2, r


@needs_full
def test_close_kills_everything_even_after_the_worker_died(shared, monkeypatch):
    """A setsid'd grandchild that cleared its death signal, a call that tried to SIGKILL its
    supervisor (refused), and then the supervisor SIGKILLed anyway (as the pool does when a worker
    stops answering): nothing is left, then or after close()."""
    monkeypatch.syspath_prepend(str(HERE))
    pool = RewardPool("hostile_rewards:hostile", workers=1, timeout_s=60.0, memory_bytes=256 * MiB,
                      max_abs_reward=1e12)
    pids_file = shared / "close"
    done = {}
    thread = threading.Thread(target=lambda: done.update(r=_attack(
        pool, "escape_and_linger", pids_file=str(pids_file), hang=True, kill_supervisor=True)))
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not pids_file.exists():
            assert time.monotonic() < deadline, "the call never started its grandchild"
            time.sleep(0.05)
        grandchild, call, kill_errno = map(int, pids_file.read_text().split())
        assert kill_errno == errno.EPERM
        supervisor = _workers(pool)[0]
        assert alive(supervisor) and alive(grandchild)
        uid = int(Path(f"/proc/{grandchild}/status").read_text().split("Uid:")[1].split()[0])
        os.kill(supervisor, signal.SIGKILL)
        # The pool sees its worker die (the answer pipe's end) and kills the calls' cgroup at once.
        assert wait_dead([supervisor, grandchild, call]) == []
    finally:
        pool.close()
    thread.join(30)
    assert (done["r"].reward, done["r"].reason) == (0.0, "worker_died")
    assert uid_processes(uid) == []


def test_module_state_loads_once_per_worker_and_each_call_is_a_fresh_process(range_pool):
    for _ in range(2):
        task = {"where": 1, "trainer_uid": os.getuid()}
        r = range_pool.score(completion="", answer=None, prompt="", task=task)
        assert r.reward == 1.0 and r.reason is None, r
        assert r.metrics["loaded_by_parent"] == 1 and r.metrics["own_process"] == 1, r
        assert r.metrics["calls_seen"] == 1  # each call starts from the module as the worker loaded it
        assert r.metrics["other_uid"] == float(FULL)


@pytest.mark.parametrize("value,reason", [
    (1e6, None), (-1e6, None),  # the bound itself is in range
    (1e6 * (1 + 1e-12), "out_of_range"), (-1e7, "out_of_range"), (1e308, "out_of_range"),
    (float("inf"), "out_of_range"), (float("nan"), "out_of_range"), (10**400, "out_of_range"),
    ({"reward": 1.0, "m": 1e9}, "out_of_range"), ({"reward": 1.0, "m": float("-inf")}, "out_of_range"),
    ({"reward": 1.0, "m": 5.0}, None),
])
def test_values_out_of_range_score_zero(range_pool, value, reason):
    r = range_pool.score(completion="", answer=None, prompt="", task={"value": value})
    assert r.reason == reason, r
    if reason:
        assert r.reward == 0.0 and r.metrics == {}
    else:
        assert r.reward == (value if isinstance(value, float) else 1.0)


@pytest.fixture(scope="module")
def range_pool():
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(HERE))
    pool = RewardPool("user_rewards:returns_value", workers=1)
    yield pool
    pool.close()
    mp.undo()


def test_max_abs_reward_is_the_pools(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    pool = RewardPool("user_rewards:returns_value", workers=1, max_abs_reward=10)
    try:
        assert pool.score(completion="", answer=None, prompt="", task={"value": 10.0}).reward == 10.0
        r = pool.score(completion="", answer=None, prompt="", task={"value": 10.5})
        assert (r.reward, r.reason) == (0.0, "out_of_range") and "max_abs_reward (10)" in r.error
    finally:
        pool.close()
    for bad in (0, -1, float("inf"), float("nan"), True, "1e6"):
        with pytest.raises(ValueError, match="max_abs_reward must be a finite number > 0"):
            RewardPool("math", max_abs_reward=bad)


def test_the_built_ins_calls_keep_no_api_key_of_the_trainers():
    env = {"PATH": "/usr/bin", "LANG": "C.UTF-8", "MIXRL_SANDBOX_UID_BASE": "1610612736",
           "WANDB_API_KEY": "k", "HF_TOKEN": "t", "OPENAI_API_KEY": "o", "HOME": "/root"}
    assert builtin_environment(env) == {"PATH": "/usr/bin", "LANG": "C.UTF-8",
                                        "MIXRL_SANDBOX_UID_BASE": "1610612736"}
