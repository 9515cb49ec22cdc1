"""The sandbox's CPU-time and process-count limits, asserted (issue 37): with either limit dropped
from ``envs/sandbox.py`` the other sandbox tests still passed (a 1 s CPU limit became a 6 s
wall-clock run; 83 processes ran against a limit of 16). Each run here takes a few seconds at most."""

from __future__ import annotations

import time

import pytest

from envs.sandbox import INIT_PIDS, Sandbox, SandboxLimits, sandbox_available

pytestmark = pytest.mark.skipif(not sandbox_available(), reason="needs root + unshare (namespaces)")

# Forks up to 40 sleeping children (stopping at the first refused fork), then counts the live
# processes in the sandbox's own pid namespace. No shell loop: a shell that cannot fork dies.
SPAWNER = ("python3 -c \"import os, time\nn = 0\nfor i in range(40):\n    try:\n"
           "        pid = os.fork()\n    except OSError:\n        break\n    if pid == 0:\n"
           "        time.sleep(5)\n        os._exit(0)\n    n += 1\n"
           "live = sum(p.isdigit() for p in os.listdir('/proc'))\nprint('spawned', n, 'live', live)\"")


def test_a_one_second_cpu_limit_stops_a_busy_loop_long_before_the_wall_clock():
    # a generous wall clock: on a loaded machine 1 s of CPU can take a few seconds to accrue
    with Sandbox(SandboxLimits(wall_seconds=10.0, cpu_seconds=1, max_output_bytes=4096)) as sb:
        t0 = time.monotonic()
        r = sb.run("while :; do :; done")
        elapsed = time.monotonic() - t0
    # killed by the CPU rlimit (SIGKILL at the hard limit: 128 + 9), not by the wall clock
    assert not r.timed_out and r.exit_code == 137 and not r.ok, r
    assert elapsed < 8.0, elapsed


def test_a_process_limit_of_16_stops_a_spawner():
    with Sandbox(SandboxLimits(wall_seconds=6.0, cpu_seconds=2, max_processes=16,
                               max_output_bytes=4096)) as sb:
        r = sb.run(SPAWNER)
    assert r.ok, r
    spawned, live = (int(w) for w in r.output.split()[1::2])
    # the jail's init and the spawner itself count too: INIT_PIDS more are allowed than the limit
    assert 8 <= spawned < 16 and live <= 16 + INIT_PIDS, r.output
    # the same spawner under a roomier limit forks all 40: the limit above is what stopped it
    with Sandbox(SandboxLimits(wall_seconds=6.0, cpu_seconds=2, max_processes=64,
                               max_output_bytes=4096)) as sb:
        assert sb.run(SPAWNER).output.startswith("spawned 40 live ")
