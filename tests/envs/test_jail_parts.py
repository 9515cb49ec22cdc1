"""The jail's parts on their own: the cgroup file contract (v1 and v2, on fake cgroupfs trees), uid
leases across processes, and the one-line refusal where a sandbox could not bound memory."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from envs import sandbox as sbx
from envs.jail.cgroups import SandboxCgroup, detect
from envs.jail.uids import UidLease, UidsExhausted


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    return root


def test_detect_prefers_v2_with_controllers_else_v1(tmp_path):
    v2 = _tree(tmp_path / "v2", {"cgroup.controllers": "cpuset cpu io memory hugetlb pids rdma\n"})
    assert detect(v2) == ("v2", {"unified": v2})
    # A hybrid host: v1 controllers, plus a v2 tree without them (this machine and CI).
    hybrid = _tree(tmp_path / "hybrid", {"memory/memory.limit_in_bytes": "9223372036854771712\n",
                                         "pids/cgroup.procs": "", "unified/cgroup.controllers": "hugetlb\n"})
    assert detect(hybrid) == ("v1", {"memory": hybrid / "memory", "pids": hybrid / "pids"})
    v2_without = _tree(tmp_path / "v2-no-memory", {"cgroup.controllers": "cpu io pids\n"})
    assert detect(v2_without) is None
    assert detect(tmp_path / "nothing") is None


def test_v2_contract_on_a_fake_tree(tmp_path):
    sb = "mixrl-sandbox/sb-200001"
    root = _tree(tmp_path, {"cgroup.controllers": "memory pids\n", "cgroup.subtree_control": "cpu\n",
                            # a cgroup left by a dead owner, as the kernel would have filled it
                            f"{sb}/memory.swap.max": "max\n", f"{sb}/cgroup.kill": "",
                            f"{sb}/cgroup.procs": ""})
    cg = SandboxCgroup("sb-200001", memory_bytes=256 << 20, max_pids=18, root=root)
    d = root / sb
    assert cg.version == "v2" and cg.dirs == {"unified": d}
    assert (d / "memory.max").read_text() == str(256 << 20)
    assert (d / "memory.swap.max").read_text() == "0"
    assert (d / "pids.max").read_text() == "18"
    # Controllers are handed down each level: the root's list and the parent's.
    assert (root / "cgroup.subtree_control").read_text() == "+memory +pids"
    assert (root / "mixrl-sandbox/cgroup.subtree_control").read_text() == "+memory +pids"
    assert cg.procs_files == [d / "cgroup.procs"]
    assert cg.kill() and (d / "cgroup.kill").read_text() == "1"


def test_v1_contract_on_a_fake_tree(tmp_path):
    root = _tree(tmp_path, {"memory/memory.limit_in_bytes": "9223372036854771712\n",
                            "pids/cgroup.procs": "",
                            "memory/jail/sb-7/memory.limit_in_bytes": "9223372036854771712\n",
                            "memory/jail/sb-7/memory.memsw.limit_in_bytes": "9223372036854771712\n"})
    cg = SandboxCgroup("sb-7", memory_bytes=100 << 20, max_pids=10, root=root, parent="jail")
    mem, pids = root / "memory/jail/sb-7", root / "pids/jail/sb-7"
    assert cg.version == "v1" and cg.dirs == {"memory": mem, "pids": pids}
    assert (mem / "memory.limit_in_bytes").read_text() == str(100 << 20)
    assert (mem / "memory.memsw.limit_in_bytes").read_text() == str(100 << 20)  # swap cannot lift it
    assert (pids / "pids.max").read_text() == "10"
    assert cg.procs_files == [mem / "cgroup.procs", pids / "cgroup.procs"]
    assert cg.pids() == [] and cg.kill()


def test_v1_kill_empties_a_real_cgroup():
    """The kill loop against the kernel: a process that left its session and group still dies."""
    if sbx.cgroup_version() != "v1":
        pytest.skip("needs root and cgroup v1")
    cg = SandboxCgroup(f"test-kill-{os.getpid()}", memory_bytes=64 << 20, max_pids=8)
    try:
        procs = " ".join(map(str, cg.procs_files))
        proc = subprocess.Popen(["/bin/sh", "-c", f'for f in {procs}; do echo $$ > $f; done; '
                                 'setsid sleep 60 & sleep 60'], start_new_session=True)
        for _ in range(200):
            if len(cg.pids()) >= 2:
                break
            subprocess.run(["sleep", "0.01"])
        assert len(cg.pids()) >= 2 and proc.pid in cg.pids()
        assert cg.kill() and cg.pids() == []
        assert proc.wait(5) == -9
    finally:
        cg.remove()
    assert not any(d.exists() for d in cg.dirs.values())


_HOLD = textwrap.dedent("""
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location("uids", sys.argv[3])  # stdlib only: no package import
    uids = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(uids)
    lease = uids.UidLease(base=int(sys.argv[1]), count=2, lock_dir=sys.argv[2])
    print(lease.uid, flush=True)
    sys.stdin.read()
""")


def test_two_processes_get_different_uids_and_a_dead_one_frees_its_uid(tmp_path):
    base = 300_000 + os.getpid() % 1000 * 10
    module = Path(sbx.__file__).with_name("jail") / "uids.py"
    holders = [subprocess.Popen([sys.executable, "-I", "-c", _HOLD, str(base), str(tmp_path), str(module)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
               for _ in range(2)]
    try:
        uids = {int(h.stdout.readline()) for h in holders}
        assert uids == {base, base + 1}
        with pytest.raises(UidsExhausted, match="all 2 sandbox uids"):
            UidLease(base=base, count=2, lock_dir=tmp_path)
        holders[0].kill()  # dies without releasing: its descriptor, and so its lock, goes with it
        holders[0].wait()
        lease = UidLease(base=base, count=2, lock_dir=tmp_path)
        assert lease.uid in uids
        lease.release()
    finally:
        for h in holders:
            h.kill()
            h.wait()


def test_refusal_is_one_line_and_the_opt_out_works(monkeypatch):
    if os.geteuid() != 0:
        with pytest.raises(sbx.SandboxUnavailable, match="not root"):
            sbx.check_jail_support()
        return
    # No usable cgroup: a parent that cannot be created (a path through a file) under the real mounts.
    monkeypatch.setenv("MIXRL_SANDBOX_CGROUP", "cgroup.procs/x")
    sbx.cgroup_version.cache_clear()
    try:
        if sbx.sandbox_available() and sbx.detect() is not None:
            with pytest.raises(sbx.SandboxUnavailable) as e:
                sbx.check_jail_support(False)
            line = str(e.value)
            assert "\n" not in line and "memory and pids" in line and "allow_unbounded_memory: true" in line
            with pytest.raises(sbx.SandboxUnavailable, match="allow_unbounded_memory"):
                sbx.Sandbox()
        sbx.check_jail_support(True)
        monkeypatch.setenv(sbx.ALLOW_UNBOUNDED_ENV, "1")
        sbx.check_jail_support(False)
    finally:
        monkeypatch.delenv("MIXRL_SANDBOX_CGROUP")
        sbx.cgroup_version.cache_clear()
    # A non-root caller gets the same kind of line (effective uid only; back to root after).
    os.seteuid(65534)
    try:
        assert "not root" in sbx.jail_problem()
    finally:
        os.seteuid(0)


def test_shell_env_refuses_without_cgroups_and_runs_rlimits_only_when_told(monkeypatch):
    if not sbx.sandbox_available() or sbx.detect() is None:
        pytest.skip("needs root, namespaces and cgroups (to take the cgroups away)")
    import numpy as np

    from convert.tokenizer import char_tokenizer
    from envs import make_env

    tok = char_tokenizer()
    monkeypatch.setenv("MIXRL_SANDBOX_CGROUP", "cgroup.procs/x")
    sbx.cgroup_version.cache_clear()
    try:
        task = make_env("shell", tok, families=("write",)).sample_task(np.random.default_rng(0), "t0")
        with pytest.raises(sbx.SandboxUnavailable, match="allow_unbounded_memory: true"):
            make_env("shell", tok).start(task)
        env = make_env("shell", tok, allow_unbounded_memory=True, families=("write",))
        task = env.sample_task(np.random.default_rng(0), "t0")
        assert task.payload["allow_unbounded_memory"] is True
        with make_env("shell", tok).start(task) as ep:  # a sampler's env, built with defaults
            assert ep.sandbox.cgroup is None and ep.sandbox.uid >= 0x6000_0000
            assert ep.sandbox.run("id -u; echo ok > out.txt; cat out.txt").output == f"{ep.sandbox.uid}\nok\n"
    finally:
        monkeypatch.delenv("MIXRL_SANDBOX_CGROUP")
        sbx.cgroup_version.cache_clear()


def test_code_reward_dataset_refuses_at_load_without_cgroups(monkeypatch, tmp_path):
    if not sbx.sandbox_available() or sbx.detect() is None:
        pytest.skip("needs root, namespaces and cgroups (to take the cgroups away)")
    from envs.dataset import check_options

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "p", "tests": ["assert f() == 1"]}\n')
    check_options({"path": str(rows), "reward": "code"})  # cgroups here: fine
    monkeypatch.setenv("MIXRL_SANDBOX_CGROUP", "cgroup.procs/x")
    sbx.cgroup_version.cache_clear()
    try:
        with pytest.raises(ValueError, match="^dataset: reward code: sandbox: no usable cgroup") as e:
            check_options({"path": str(rows), "reward": "code"})
        assert "\n" not in str(e.value)
        check_options({"path": str(rows), "reward": "code", "allow_unbounded_memory": True})
        check_options({"path": str(rows), "reward": "exact"})  # no sandbox, no check
        with pytest.raises(ValueError, match="must be true or false"):
            check_options({"path": str(rows), "reward": "code", "allow_unbounded_memory": "yes"})
    finally:
        monkeypatch.delenv("MIXRL_SANDBOX_CGROUP")
        sbx.cgroup_version.cache_clear()


def test_shell_config_refused_at_load_without_cgroups(monkeypatch):
    if not sbx.sandbox_available() or sbx.detect() is None:
        pytest.skip("needs root, namespaces and cgroups (to take the cgroups away)")
    from trainer_jax.config.run import TasksConfig

    monkeypatch.setenv("MIXRL_SANDBOX_CGROUP", "cgroup.procs/x")
    sbx.cgroup_version.cache_clear()
    try:
        with pytest.raises(ValueError, match="shell env: sandbox: no usable cgroup"):
            TasksConfig(env="shell")
        TasksConfig(env="mix", mix=[{"env": "shell", "options": {"allow_unbounded_memory": True}}])
    finally:
        monkeypatch.delenv("MIXRL_SANDBOX_CGROUP")
        sbx.cgroup_version.cache_clear()
    TasksConfig(env="shell")  # cgroups back: accepted


def test_limits_must_be_positive_numbers():
    with pytest.raises(ValueError, match="sandbox limits: disk_bytes must be a number > 0, got 0"):
        sbx.SandboxLimits(disk_bytes=0)
    with pytest.raises(ValueError, match="max_processes must be a number > 0, got 'many'"):
        sbx.SandboxLimits(max_processes="many")


def test_a_uid_range_among_ordinary_users_is_refused(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="base must be >= 65536"):
        UidLease(base=1000, count=4, lock_dir=tmp_path)
    if sbx.sandbox_available():
        monkeypatch.setenv("MIXRL_SANDBOX_UID_BASE", "1000")
        with pytest.raises(sbx.SandboxUnavailable, match="^sandbox: sandbox uid range 1000"):
            sbx.Sandbox()


def test_a_uid_range_on_a_subordinate_id_map_is_refused(tmp_path):
    """/etc/subuid ranges belong to users' rootless containers: a lease kills whatever runs as its
    uid, so a range touching one is refused in one line (the default sits far above useradd's)."""
    from envs.jail.uids import DEFAULT_BASE, DEFAULT_COUNT, subordinate_overlap

    subuid = tmp_path / "subuid"
    subuid.write_text("alice:100000:65536\nbob:165536:65536\n# junk line\n")
    files = (str(subuid), str(tmp_path / "missing"))
    assert subordinate_overlap(200_000, 1024, files) == f"{subuid}: bob:165536:65536"
    assert subordinate_overlap(231_072, 1024, files) is None       # just past bob's map
    assert subordinate_overlap(99_000, 1000, files) is None        # ends where alice's starts
    assert subordinate_overlap(DEFAULT_BASE, DEFAULT_COUNT, files) is None
