"""``scripts/throwaway_root.sh``, where the sandbox's mutants run (docs/testing.md): what the command
writes is gone afterwards except in ``--keep`` directories, it sees none of the host's processes
and no network but its own loopback, and its exit status is the script's."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "throwaway_root.sh"


def _can_unshare() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "--mount", "--pid", "--net", "--fork", "true"],
                          capture_output=True, timeout=30).returncode == 0


pytestmark = pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare (namespaces)")


def test_writes_vanish_but_kept_directories_and_the_host_is_out_of_reach(tmp_path):
    kept, scratch = tmp_path / "kept", tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "old").write_text("host")
    host = os.getpid()
    before = set(Path("/tmp").glob("throwaway-root.*"))
    command = (f"echo inside > {scratch}/new && rm {scratch}/old && echo result > {kept}/out && "
               f"pwd > {kept}/cwd && "
               f"if kill -0 {host} 2>/dev/null; then echo host-visible; else echo host-hidden; fi && "
               "python3 -c 'import socket; s = socket.create_connection((\"127.0.0.1\", 9), 1)' 2>&1 "
               "| grep -q Refused && echo loopback-up && "
               "tail -n +3 /proc/net/dev | cut -d: -f1 && exit 7")
    out = subprocess.run([str(SCRIPT), "--keep", str(kept), "--", "sh", "-c", command],
                         capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert out.returncode == 7, out.stdout + out.stderr
    lines = out.stdout.split()
    assert lines[:2] == ["host-hidden", "loopback-up"], out.stdout
    assert lines[2:] == ["lo"], out.stdout  # the namespace's only interface
    # The writes outside --keep are gone, the file removed inside is still here.
    assert sorted(p.name for p in scratch.iterdir()) == ["old"]
    assert (scratch / "old").read_text() == "host"
    assert (kept / "out").read_text() == "result\n"
    assert (kept / "cwd").read_text() == f"{tmp_path}\n"
    assert set(Path("/tmp").glob("throwaway-root.*")) <= before, "the script left its mount point behind"


def test_a_missing_command_is_one_line():
    out = subprocess.run([str(SCRIPT), "--keep", "/tmp/x"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "no command" in out.stderr, out.stderr
