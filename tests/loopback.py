"""Which peers the tests' processes talk to: the suite's traffic must stay on 127.0.0.0/8.

``off_loopback(pids)`` reads each process's sockets from ``/proc/<pid>/fd`` (socket inodes) and
``/proc/<pid>/net/{tcp,tcp6,udp,udp6}`` (the tables of *that process's* network namespace, so a
process in a namespace of its own is judged by its own table) and returns every connection whose
remote end is not a loopback address. A listener (``0.0.0.0:P``, remote all zeros) has no peer and
is fine; so is an unconnected UDP socket. ``LoopbackWatch`` samples a set of processes (a fixed
list, the test process's tree, or whatever a callable returns) every ``every_s`` while a test runs
and keeps what it saw: connections are judged while they exist, not after the fact.
"""

from __future__ import annotations

import ipaddress
import os
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

_TABLES = ("tcp", "tcp6", "udp", "udp6")


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """``/proc/net/tcp``'s ``0100007F`` / 32-hex-digit IPv6 form: 32-bit words in host order."""
    raw = bytes.fromhex(hex_addr)
    host_order = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)) \
        if sys.byteorder == "little" else raw
    return ipaddress.ip_address(host_order)


def is_loopback(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """127.0.0.0/8, ::1, or an IPv4-mapped 127.x address (a dual-stack socket's view of one)."""
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def peer_host(endpoint: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The address of an ``"ip:port"`` / ``"[ip6]:port"`` endpoint; an IPv4-mapped IPv6 address
    (how a dual-stack socket, e.g. Ray's, sees an IPv4 peer) as its IPv4 address."""
    addr = ipaddress.ip_address(endpoint.rsplit(":", 1)[0].strip("[]"))
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def parse_table(text: str, table: str) -> dict[int, tuple[str, str, str]]:
    """``inode -> (local "ip:port", remote "ip:port", state hex)`` of one ``/proc/net/<table>``
    text; only sockets with a remote end (connected, or connecting)."""
    out = {}
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) < 10:
            continue
        (lip, lport), (rip, rport), state, inode = f[1].split(":"), f[2].split(":"), f[3], int(f[9])
        remote = _address(rip)
        if remote.is_unspecified:  # a listener, or a UDP socket never connected: no peer
            continue
        fmt = "{}:{}" if remote.version == 4 else "[{}]:{}"
        out[inode] = (fmt.format(_address(lip), int(lport, 16)), fmt.format(remote, int(rport, 16)), state)
    return out


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes  # gone, or not ours to read
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _cmdline(pid: int) -> str:
    try:
        return " ".join(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split())[:160]
    except OSError:
        return "?"


def _netns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def connections(pids: Iterable[int]) -> list[tuple[int, str, str, str]]:
    """``(pid, table, local, remote)`` of every socket of ``pids`` that has a peer. The tables are
    read once per network namespace, from a member's ``/proc/<pid>/net``."""
    by_ns: dict[str, dict[int, set[int]]] = {}
    for pid in set(pids):
        inodes = _socket_inodes(pid)
        ns = _netns(pid) if inodes else None
        if ns:
            by_ns.setdefault(ns, {})[pid] = inodes
    out = []
    for members in by_ns.values():
        owner = {inode: pid for pid, inodes in members.items() for inode in inodes}
        for table in _TABLES:
            text = None
            for pid in members:  # any member that is still there
                try:
                    text = Path(f"/proc/{pid}/net/{table}").read_text()
                    break
                except OSError:
                    continue  # gone, or no IPv6 in this kernel
            for inode, (local, remote, _) in parse_table(text or "", table).items():
                if inode in owner:
                    out.append((owner[inode], table, local, remote))
    return out


def off_loopback(pids: Iterable[int], conns: list[tuple[int, str, str, str]] | None = None) -> list[str]:
    """One line per connection of ``pids`` whose peer is off 127.0.0.0/8: pid, command, sockets."""
    bad = []
    for pid, table, local, remote in connections(pids) if conns is None else conns:
        if not is_loopback(peer_host(remote)):
            bad.append(f"pid {pid} ({_cmdline(pid)}): {table} {local} -> {remote}")
    return sorted(bad)


def tree(pid: int) -> list[int]:
    """``pid`` and every live descendant, from each thread's ``/proc/<pid>/task/<tid>/children``
    (a scan of every ``/proc/*/stat`` where the kernel lacks that file)."""
    if not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"):
        return _tree_by_scan(pid)
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                todo += [int(c) for c in Path(f"/proc/{p}/task/{tid}/children").read_text().split()]
            except OSError:
                continue
    return out


def _tree_by_scan(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


class LoopbackWatch:
    """Samples the processes ``sources`` name (callables returning pids) every ``every_s`` in a
    thread until ``stop()``; ``found`` holds each distinct off-loopback connection seen, ``seen``
    every distinct connection looked at (so a test can show the watch saw its traffic at all)."""

    def __init__(self, *sources: Callable[[], Iterable[int]], every_s: float = 1.0) -> None:
        self.sources = list(sources)
        self.every_s = every_s
        self.found: list[str] = []
        self.seen: set[tuple[str, str, str]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loopback-watch", daemon=True)

    def add(self, source: Callable[[], Iterable[int]]) -> None:
        """Watch the processes ``source()`` returns too (e.g. daemons that are nobody's child)."""
        self.sources.append(source)

    def sample(self) -> None:
        pids: set[int] = set()
        for source in list(self.sources):
            try:
                pids.update(source())
            except Exception:  # a source reading processes that just went away
                continue
        conns = connections(pids)
        self.seen.update((table, local, remote) for _, table, local, remote in conns)
        for line in off_loopback(pids, conns):
            if line not in self.found:
                self.found.append(line)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def start(self) -> LoopbackWatch:
        self._thread.start()  # the first sample after every_s: a test's start has no traffic yet
        return self

    def stop(self) -> list[str]:
        """Stop sampling (after one last sample); what was found."""
        self._stop.set()
        self._thread.join(timeout=10)
        self.sample()
        return self.found
