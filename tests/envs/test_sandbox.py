"""The sandbox contains what an agent's command may try; the episode records why it ended."""

import os
import socket
import time

import pytest

from envs.sandbox import Sandbox, SandboxLimits, sandbox_available

pytestmark = pytest.mark.skipif(not sandbox_available(), reason="needs root + unshare (namespaces)")


@pytest.fixture
def sandbox():
    with Sandbox(SandboxLimits(wall_seconds=2.0, cpu_seconds=2, max_output_bytes=1024)) as sb:
        yield sb


def test_runs_commands_in_its_directory(sandbox):
    sandbox.write_file("a.txt", "17\n")
    r = sandbox.run("cat a.txt && echo 5 > b.txt && pwd")
    assert r.ok and r.isolated and r.output == "17\n/work\n"
    assert (sandbox.workdir / "b.txt").read_text() == "5\n"


def test_cannot_write_or_read_outside(sandbox, tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    r = sandbox.run(f"echo pwned > {outside}; cat {outside}; echo x > /usr/evil; "
                    "cat /etc/passwd; ls /root; echo done")
    assert outside.read_text() == "secret"
    assert "secret" not in r.output and "root:" not in r.output and r.output.endswith("done\n")
    assert not os.path.exists("/usr/evil")


def test_no_network(sandbox):
    # A listener on the host loopback must be unreachable from inside.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        r = sandbox.run(f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), 1); "
                        "print('connected')\" 2>&1 | tail -1")
        assert "connected" not in r.output and "Network is unreachable" in r.output
    finally:
        server.close()


def test_runaway_command_is_killed(sandbox):
    r = sandbox.run("while true; do :; done")
    assert r.timed_out and r.exit_code is None and not r.ok


def test_flood_of_output_is_cut(sandbox):
    r = sandbox.run("yes gigabytes")
    assert r.output_truncated and len(r.output) <= 1024


def test_fork_bomb_and_big_files_are_bounded(sandbox):
    r = sandbox.run("python3 -c \"open('big','wb').write(b'0' * 50_000_000)\" 2>&1 | tail -1")
    assert "File too large" in r.output or "MemoryError" in r.output
    big = sandbox.workdir / "big"
    assert not big.exists() or big.stat().st_size <= 8 * 1024**2
    r = sandbox.run("for i in $(seq 200); do sleep 5 & done; wait")
    assert not r.ok  # either the process limit or the wall clock stops it


def test_directory_removed_on_close():
    sb = Sandbox()
    sb.write_file("x", "1")
    d = sb.workdir
    sb.close()
    assert not d.exists()
    with pytest.raises(ValueError, match="outside"):
        Sandbox().write_file("../escape", "x")


# --- model-written code: no privilege to gain, limits that hold, nothing writable but /work


def test_setuid_binaries_gain_nothing(sandbox):
    r = sandbox.run("grep -E '^(NoNewPrivs|CapBnd|CapEff|Uid)' /proc/self/status; "
                    "awk '{print $5, $6}' /proc/self/mountinfo; "
                    "/usr/bin/mount -t tmpfs none /work 2>&1 | head -1; echo mount=$?; id -u")
    lines = r.output.splitlines()
    assert "NoNewPrivs:\t1" in lines and "CapBnd:\t0000000000000000" in lines
    assert "CapEff:\t0000000000000000" in lines and lines[-1] == str(sandbox.uid)
    assert sandbox.uid >= 0x6000_0000  # the sandbox's own uid, not nobody (shared host-wide)
    mounts = [ln for ln in lines if ln.startswith("/")]
    assert mounts and all("nosuid" in opts for _, opts in (m.split(" ", 1) for m in mounts)), mounts
    # The setuid-root mount(8) runs, but as nobody: the mount is refused.
    assert not (sandbox.workdir / "lost+found").exists()
    assert any(w in r.output for w in ("only root", "must be superuser", "permission denied",
                                        "Operation not permitted"))


def test_nothing_outside_work_is_writable():
    with Sandbox(SandboxLimits(wall_seconds=30.0, cpu_seconds=20, max_output_bytes=65536)) as sb:
        r = sb.run("find / -maxdepth 4 -path /proc -prune -o -writable -print 2>/dev/null; "
                   "for d in / /usr /tmp /etc /dev; do touch $d/x 2>/dev/null && echo wrote $d; done; "
                   "echo end")
    paths = r.output.splitlines()
    assert paths[-1] == "end" and not any(p.startswith("wrote") for p in paths)
    assert set(paths[:-1]) <= {"/work", "/dev/null"}, paths


def test_fork_bomb_and_memory_hog_stay_inside_their_limits():
    limits = SandboxLimits(wall_seconds=3.0, cpu_seconds=2, max_processes=16, max_output_bytes=4096)
    with Sandbox(limits) as sb:
        t0 = time.monotonic()
        bomb = sb.run("bomb() { bomb 2>/dev/null | bomb 2>/dev/null & }; bomb; sleep 1; "
                      "n=0; while [ $n -lt 20 ]; do sleep 0 & n=$((n+1)); done 2>&1 | head -1")
        # The run ends within the wall clock; when the probe loop runs while the bomb still holds
        # the process limit, the shell says it cannot fork (under heavy load the bomb may already
        # be gone by then, so the message is not required: a run in CI showed empty output).
        assert time.monotonic() - t0 < limits.wall_seconds + 5
        assert bomb.output == "" or "fork" in bomb.output.lower(), bomb.output
        hog = sb.run("python3 -c 'x = bytearray(4 * 1024**3)' 2>&1 | tail -1")
        assert "MemoryError" in hog.output
        after = sb.run("echo fine")
        assert after.ok and after.output == "fine\n"  # the sandbox (and the host) carry on


def test_seccomp_refuses_namespace_mount_and_ptrace_calls(sandbox):
    # unshare(0) and setns are harmless without the filter (they return 0 / EBADF); with it, EPERM.
    probe = ("import ctypes; l = ctypes.CDLL(None, use_errno=True); "
             "print(*[(l.syscall(n, *a), ctypes.get_errno()) for n, a in ((272, (0,)), (308, (-1, 0)), "
             "(101, (16, 1, 0, 0)), (39, ()))])")
    r = sandbox.run(f"grep Seccomp: /proc/self/status; python3 -c '{probe}'")
    lines = r.output.splitlines()
    assert lines[0] == "Seccomp:\t2", r.output
    unshare, setns, ptrace, getpid = (eval(x) for x in lines[1].replace(") (", ")|(").split("|"))
    assert unshare == (-1, 1) and setns == (-1, 1) and ptrace == (-1, 1)
    assert getpid[0] > 0  # everything else goes through
