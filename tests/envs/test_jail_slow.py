"""Longer hostile runs against the jail at its default limits, with the issue's own figures (issue 31:
880 MiB of memfd and 1,027 MiB over six processes passed the 512 MiB limit, 328 MiB went to disk in
one command, leftovers and a neighbour's bomb failed other episodes). ``-m slow``."""

import concurrent.futures
import textwrap
import threading
import time

import pytest

from envs.jail.uids import uid_processes
from envs.sandbox import Sandbox, SandboxLimits, cgroup_version, sandbox_available

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sandbox_available() or cgroup_version() is None,
                                 reason="needs root, namespaces and a memory+pids cgroup")]
MiB = 1024**2


def _peak(sb: Sandbox) -> int:
    mem = sb.cgroup.dirs["memory"]
    name = "memory.max_usage_in_bytes" if cgroup_version() == "v1" else "memory.peak"
    return int((mem / name).read_text()) if (mem / name).exists() else 0


def test_880_mib_of_memfd_stops_at_512():
    hog = textwrap.dedent("""\
        import os
        fds = []
        for i in range(220):                              # 880 MiB in 4 MiB memfd files
            fd = os.memfd_create("m%d" % i)
            os.write(fd, b"x" * (4 << 20))
            fds.append(fd)
            print((i + 1) * 4, flush=True)
        print("done")
    """)
    with Sandbox(SandboxLimits(wall_seconds=60, cpu_seconds=30)) as sb:
        sb.write_file("hog.py", hog)
        r = sb.run("python3 hog.py > log 2>&1; echo status=$?; grep -E '^([0-9]+|done)$' log | tail -1")
        peak = _peak(sb)
    words = r.output.split()  # the shell's "Killed" comes too
    last = max(int(w) for w in words if w.isdigit())
    print(f"memfd: {[w for w in words if w.startswith('status')]}, last MiB written {last}, "
          f"cgroup peak {peak / MiB:.0f} MiB")
    assert "status=137" in words and "done" not in words and last < 512
    assert peak <= 512 * MiB


def test_1027_mib_over_six_processes_stops_at_512():
    each = textwrap.dedent("""\
        import sys, time
        b = bytearray(172 * 1024 * 1024)                  # 6 x 172 MiB = 1,032 MiB, each under RLIMIT_AS
        print("held", sys.argv[1], flush=True)
        time.sleep(3)
    """)
    with Sandbox(SandboxLimits(wall_seconds=60, cpu_seconds=30)) as sb:
        sb.write_file("each.py", each)
        r = sb.run("for i in 1 2 3 4 5 6; do python3 each.py $i & done; wait; echo end")
        peak = _peak(sb)
    held = r.output.count("held")
    print(f"six processes: {held} held their 172 MiB at once, cgroup peak {peak / MiB:.0f} MiB")
    assert held < 6 and peak <= 512 * MiB


def test_328_mib_to_disk_stops_at_the_area():
    with Sandbox(SandboxLimits(wall_seconds=60, cpu_seconds=30)) as sb:
        r = sb.run("for i in $(seq 82); do yes 0123456789abcdef | head -c 4000000 > f$i || break; done; "
                   "du -sk /work")
        used = sum(p.stat().st_size for p in sb.workdir.iterdir())
    print(f"disk: {used / MiB:.1f} MiB written of 328 asked, area 64 MiB")
    assert "No space left" in r.output and used <= 64 * MiB


def test_daemons_of_every_kind_are_gone_after_close():
    with Sandbox() as sb:
        r = sb.run("setsid -f sleep 401; nohup sleep 402 >/dev/null 2>&1 & "
                   "(sleep 403 &) ; sh -c 'setsid sleep 404 >/dev/null 2>&1 </dev/null &'; echo up")
        assert r.ok and uid_processes(sb.uid) == []
        t = sb.run("exec setsid sleep 317")  # default 5 s wall clock
        assert t.timed_out and uid_processes(sb.uid) == []
        uid = sb.uid
    assert uid_processes(uid) == []


def test_many_sandboxes_at_once_get_distinct_uids_and_leave_nothing():
    def episode(i):
        with Sandbox(SandboxLimits(wall_seconds=20)) as sb:
            start = time.monotonic()
            r = sb.run("id -u; echo $((6 * 7))")
            end = time.monotonic()
            return sb.uid, r.output.split(), list(sb.cgroup.dirs.values()), sb.workdir, start, end
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(episode, range(24)))
    assert all(out == [str(uid), "42"] for uid, out, *_ in results)
    overlapping = [(a[0], b[0]) for i, a in enumerate(results) for b in results[i + 1:]
                   if a[4] < b[5] and b[4] < a[5]]
    uids = {r[0] for r in results}
    print(f"24 sandboxes on 8 threads: {len(overlapping)} overlapping pairs, {len(uids)} uids")
    assert overlapping and all(x != y for x, y in overlapping)
    for uid, _, dirs, work, *_ in results:
        assert uid_processes(uid) == [] and not work.exists() and not any(d.exists() for d in dirs)


def test_a_shell_fork_bomb_at_default_limits_leaves_neighbours_working():
    with Sandbox() as bombed, Sandbox(SandboxLimits(wall_seconds=20)) as innocent:
        done = threading.Event()
        bomb = "exec >/dev/null 2>&1; bomb() { bomb | bomb & }; bomb; exec sleep 30"  # quiet: no output cap
        thread = threading.Thread(target=lambda: (bombed.run(bomb), done.set()))
        thread.start()
        ok = 0
        t0 = time.monotonic()
        while not done.is_set() and time.monotonic() - t0 < 30:
            r = innocent.run("for i in 1 2 3 4 5 6 7 8; do sleep 0.05 & done; wait; echo forked")
            ok += r.output == "forked\n"
            assert r.output == "forked\n", r.output
        thread.join()
        print(f"fork bomb: {ok} neighbour runs forked 8 children each while it ran")
        assert ok >= 1 and uid_processes(bombed.uid) == []
