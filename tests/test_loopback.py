"""The loopback watch itself (tests/loopback.py, run around every test by tests/conftest.py).

Its reading of ``/proc`` is compared with what the kernel tells the sockets' owners
(``getsockname`` / ``getpeername``), and an off-loopback peer is made for real without leaving the
machine: in a network namespace of its own whose loopback interface also carries 10.77.0.1, a
process connects to itself at that address. The watch must name it; everywhere else (this process,
its listeners on 0.0.0.0, IPv6 ::1) it must find nothing.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from loopback import LoopbackWatch, connections, is_loopback, off_loopback, parse_table, peer_host, tree
from shipped_setup import own_network_available


def test_the_proc_view_matches_the_sockets_own_view():
    server = socket.socket()
    server.bind(("0.0.0.0", 0))  # a listener on every interface: no peer, never flagged
    server.listen()
    client = socket.create_connection(("127.0.0.1", server.getsockname()[1]))
    accepted, _ = server.accept()
    six = socket.socket(socket.AF_INET6)
    six.bind(("::1", 0))
    six.listen()
    client6 = socket.create_connection(("::1", six.getsockname()[1]))
    try:
        mine = {(local, remote) for pid, _, local, remote in connections([os.getpid()]) if pid == os.getpid()}
        want = {(f"{a[0]}:{a[1]}", f"{b[0]}:{b[1]}") for a, b in (
            (client.getsockname(), client.getpeername()), (accepted.getsockname(), accepted.getpeername()))}
        want.add((f"[::1]:{client6.getsockname()[1]}", f"[::1]:{client6.getpeername()[1]}"))
        assert want <= mine, (want, mine)
        assert not any(local.endswith(f":{server.getsockname()[1]}") and remote.startswith("0.0.0.0")
                       for local, remote in mine)  # the listener itself is not a connection
        assert off_loopback([os.getpid()]) == []
    finally:
        for s in (client, accepted, server, client6, six):
            s.close()


def test_addresses_and_loopback_boundaries():
    # /proc/net/tcp writes 127.0.0.1:80 as 0100007F:0050, and IPv6 as four host-order words
    table = ("sl local_address rem_address st tx_queue rx_queue tr tm->when retrnsmt uid timeout inode\n"
             "   0: 0100007F:0050 0200007F:9C40 01 00000000:00000000 00:00000000 00000000 0 0 111 1\n"
             "   1: 00000000:0050 00000000:0000 0A 00000000:00000000 00:00000000 00000000 0 0 112 1\n"
             "   2: 0100007F:0051 0100000A:01BB 02 00000000:00000000 00:00000000 00000000 0 0 113 1\n")
    assert parse_table(table, "tcp") == {111: ("127.0.0.1:80", "127.0.0.2:40000", "01"),
                                         113: ("127.0.0.1:81", "10.0.0.1:443", "02")}  # 112 listens
    six = "0000000000000000FFFF00000100007F"  # ::ffff:127.0.0.1, a dual-stack socket's view
    row = f"   0: {six}:0050 {'0' * 24}01000000:0051 01 0:0 0:0 0 0 0 114 1\n"
    mapped = ipaddress.ip_address("::ffff:127.0.0.1")  # printed as Python prints it (3.13: dotted)
    assert parse_table("header\n" + row, "tcp6") == {114: (f"[{mapped}]:80", "[::1]:81", "01")}
    for addr, loop in (("127.0.0.1", True), ("127.255.255.254", True), ("128.0.0.1", False),
                       ("126.255.255.255", False), ("::1", True), ("::2", False), ("::ffff:127.0.0.9", True),
                       ("::ffff:10.0.0.1", False), ("192.0.2.2", False)):
        assert is_loopback(ipaddress.ip_address(addr)) is loop, addr
    assert str(peer_host(f"[{mapped}]:80")) == "127.0.0.1" and str(peer_host("[::1]:81")) == "::1"
    assert str(peer_host("10.0.0.1:443")) == "10.0.0.1"


_SELF_CONNECT = """
import socket, sys, time
s = socket.socket(); s.bind(("10.77.0.1", 0)); s.listen()
c = socket.create_connection(("10.77.0.1", s.getsockname()[1])); a, _ = s.accept()
print(c.getsockname()[1], s.getsockname()[1], flush=True)
time.sleep(30)
"""


@pytest.mark.off_loopback_expected
@pytest.mark.skipif(not own_network_available(), reason="needs network namespaces (root, as CI)")
def test_the_watch_names_a_peer_off_loopback_in_a_namespace_of_its_own():
    # `ip` brings lo up and gives it a second, non-loopback address; nothing here can leave the
    # namespace (it has no other interface)
    setup = "ip link set lo up && ip addr add 10.77.0.1/32 dev lo && exec \"$0\" -c \"$1\""
    proc = subprocess.Popen(["unshare", "--net", "--", "sh", "-c", setup, sys.executable, _SELF_CONNECT],
                            stdout=subprocess.PIPE, text=True)
    watch = LoopbackWatch(lambda: tree(proc.pid), every_s=0.2).start()
    try:
        client_port, server_port = proc.stdout.readline().split()
        time.sleep(0.5)  # two samples at least
        found = watch.stop()
        # both ends, each from its own side; the command line names the process
        assert sorted(line.split(": ", 1)[1] for line in found) == sorted([
            f"tcp 10.77.0.1:{client_port} -> 10.77.0.1:{server_port}",
            f"tcp 10.77.0.1:{server_port} -> 10.77.0.1:{client_port}"]), found
        assert all(f"pid {proc.pid} (" in line and "socket" in line for line in found), found
        # this process, outside that namespace, sees none of it (its own table holds no 10.77.0.1)
        assert off_loopback([os.getpid()]) == []
    finally:
        watch.stop()
        proc.kill()
        proc.wait()


def test_a_child_process_tree_is_walked():
    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
                              "print(p.pid, flush=True); time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        assert {os.getpid(), child.pid, grandchild} <= set(tree(os.getpid()))
        assert tree(child.pid)[0] == child.pid and grandchild in tree(child.pid)
        assert os.getpid() not in tree(child.pid)
    finally:
        for pid in tree(child.pid)[::-1]:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        child.wait()


@pytest.mark.off_loopback_expected
@pytest.mark.skipif(not own_network_available(), reason="needs network namespaces (root, as CI)")
def test_a_test_that_talks_off_loopback_fails(tmp_path):
    """The suite's own fixture (tests/conftest.py, loaded as a plugin into a pytest of its own):
    a test whose child connects to a peer off loopback errors at teardown naming the peer (on
    loopback, every other test of the suite passes under the same fixture)."""
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "import subprocess, sys, time\n"
        f"SCRIPT = {_SELF_CONNECT!r}\n"
        "def run(addr):\n"
        "    setup = 'ip link set lo up && ip addr add 10.77.0.1/32 dev lo && exec \"$0\" -c \"$1\"'\n"
        "    p = subprocess.Popen(['unshare', '--net', '--', 'sh', '-c', setup, sys.executable,\n"
        "                          SCRIPT.replace('10.77.0.1', addr)], stdout=subprocess.PIPE, text=True)\n"
        "    p.stdout.readline(); time.sleep(1.2); p.kill(); p.wait()\n"
        "def test_off(): run('10.77.0.1')\n")
    tests_dir = str(Path(__file__).parent)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                          "--rootdir", str(tmp_path), "-c", os.devnull, str(probe)],
                         env={**os.environ, "PYTHONPATH": tests_dir, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
                         capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    # the test's own body passed; the watch's teardown failed it
    assert "1 passed, 1 error" in out.stdout, out.stdout + out.stderr
    assert "ERROR at teardown of test_off" in out.stdout and "-> 10.77.0.1:" in out.stdout, out.stdout


def test_the_suite_fixture_sees_this_tests_children(loopback_only):
    """What every test gets from tests/conftest.py: a watch over this process and its children,
    which sees a child's connection (and finds it on loopback)."""
    child = subprocess.Popen([sys.executable, "-c", "import socket, time; s = socket.socket(); "
                              "s.bind(('127.0.0.1', 0)); s.listen(); print(s.getsockname()[1], flush=True); "
                              "c, _ = s.accept(); time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        with socket.create_connection(("127.0.0.1", port)) as client:
            time.sleep(0.2)  # the child's accept
            loopback_only.sample()
            mine = f"127.0.0.1:{client.getsockname()[1]}"
            assert ("tcp", f"127.0.0.1:{port}", mine) in loopback_only.seen  # the child's end
            assert ("tcp", mine, f"127.0.0.1:{port}") in loopback_only.seen  # this process's end
            assert loopback_only.found == []
    finally:
        child.kill()
        child.wait()
