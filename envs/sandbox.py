"""Run an agent's shell command in a throwaway sandbox.

Each episode gets a fresh directory. A command runs as ``nobody`` inside new network, mount and pid
namespaces (``unshare``), chrooted into a tmpfs that holds only read-only binds of the system
directories (``/usr``, ``/bin``, ``/lib`` ...), ``/dev/null``, a private ``/proc`` and the episode
directory at ``/work``. So:

- no network: the namespace has only a loopback device, and it is down;
- no access outside the episode directory: the rest of the host filesystem is not mounted, system
  directories are read-only, and ``nobody`` cannot remount them;
- no privilege to gain: every mount is ``nosuid`` (and ``nodev`` but ``/dev/null``), the command
  starts with ``no_new_privs`` set and an empty capability bounding set (``setpriv``), so the
  host's setuid-root binaries (``mount``, ``su``, ``passwd`` ...) run with the caller's uid;
- a smaller kernel surface: a seccomp filter (``envs/seccomp_launch.py``, installed by the host's
  ``/usr/bin/python3`` just before the command runs) refuses mounts, namespaces, ``ptrace``,
  module loading, ``bpf``, io_uring and the like;
- bounded time (wall clock, enforced by killing the namespace's init), CPU seconds, address
  space, file size and process count (rlimits), and output (the reader stops and kills the
  command after ``max_output_bytes``).

Namespaces need root (or user namespaces). Where they are unavailable ``Sandbox`` refuses to run
unless ``allow_unisolated=True``, in which case only the rlimits, the timeout and the output cap
apply; ``sandbox_available()`` says which case holds.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

NOBODY = 65534
_LAUNCHER = Path(__file__).with_name("seccomp_launch.py")
_SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "etc/alternatives")

# The namespace-side setup: build the jail, then drop to nobody and run the command in /work.
_SETUP = r"""
set -eu
mount --make-rprivate /
mount -t tmpfs -o size=1m,mode=755,nosuid,nodev tmpfs "$JAIL"
for d in $SYSTEM_DIRS; do
  if [ -L "/$d" ]; then
    mkdir -p "$JAIL/$(dirname "$d")"; ln -s "$(readlink "/$d")" "$JAIL/$d"
  elif [ -d "/$d" ]; then
    mkdir -p "$JAIL/$d"; mount --rbind "/$d" "$JAIL/$d"; mount -o remount,bind,ro,nosuid,nodev "$JAIL/$d"
  fi
done
mkdir -p "$JAIL/work" "$JAIL/dev" "$JAIL/proc"
mount --bind "$WORK" "$JAIL/work"; mount -o remount,bind,nosuid,nodev "$JAIL/work"
touch "$JAIL/dev/null"; mount --bind /dev/null "$JAIL/dev/null"
mount -o remount,bind,nosuid,noexec "$JAIL/dev/null"
mount -t proc -o nosuid,nodev,noexec proc "$JAIL/proc"
mkdir "$JAIL/.mixrl"; cp "$LAUNCHER" "$JAIL/.mixrl/seccomp_launch.py"
mount -o remount,ro,nosuid,nodev "$JAIL"
exec chroot "$JAIL" setpriv --reuid=65534 --regid=65534 --clear-groups --no-new-privs \
  --inh-caps=-all --bounding-set=-all -- /usr/bin/python3 -I -S /.mixrl/seccomp_launch.py \
  /bin/sh -c 'cd /work && exec /bin/sh -c "$0"' "$CMD"
"""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    wall_seconds: float = 5.0
    cpu_seconds: int = 5
    memory_bytes: int = 512 * 1024**2
    file_bytes: int = 8 * 1024**2
    max_processes: int = 64
    max_output_bytes: int = 4096


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    output: str
    exit_code: int | None
    timed_out: bool
    output_truncated: bool
    isolated: bool

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.output_truncated


@functools.cache
def sandbox_available() -> bool:
    """Whether namespaces can be created here (root; ``unshare``, ``chroot``, ``setpriv`` and the
    system's ``/usr/bin/python3`` present)."""
    if os.geteuid() != 0 or not all(shutil.which(c) for c in ("unshare", "chroot", "prlimit", "setpriv")) \
            or not os.path.exists("/usr/bin/python3"):  # the seccomp launcher's interpreter
        return False
    probe = subprocess.run(["unshare", "--net", "--mount", "--pid", "--fork", "true"],
                           capture_output=True, timeout=10)
    return probe.returncode == 0


class Sandbox:
    """One episode's sandbox: a fresh directory and a way to run commands in it.

    Use as a context manager; the directory is removed on exit.
    """

    def __init__(self, limits: SandboxLimits | None = None, *, allow_unisolated: bool = False):
        self.limits = limits or SandboxLimits()
        self.isolated = sandbox_available()
        if not self.isolated and not allow_unisolated:
            raise RuntimeError("namespace sandbox unavailable (needs root and util-linux unshare); "
                               "pass allow_unisolated=True to run with rlimits only")
        self._base = Path(tempfile.mkdtemp(prefix="mixrl-sandbox-"))
        self.workdir = self._base / "work"
        self.workdir.mkdir()
        (self._base / "jail").mkdir()
        if self.isolated:
            os.chown(self.workdir, NOBODY, NOBODY)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        shutil.rmtree(self._base, ignore_errors=True)

    def write_file(self, name: str, content: str) -> None:
        """Place a task file in the episode directory (owned by the sandbox user)."""
        path = (self.workdir / name).resolve()
        if self.workdir.resolve() not in path.parents:
            raise ValueError(f"{name!r} is outside the sandbox directory")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        if self.isolated:
            os.chown(path, NOBODY, NOBODY)

    def _limits_prefix(self) -> list[str]:
        # rlimits through prlimit(1) rather than a preexec_fn: forking a multithreaded process
        # (JAX, torch) and running Python in the child before exec is unsafe. Root (the
        # namespace setup) is exempt from the process limit; it binds once the command is nobody.
        lim = self.limits
        return ["prlimit", f"--cpu={lim.cpu_seconds}", f"--as={lim.memory_bytes}",
                f"--fsize={lim.file_bytes}", "--core=0", f"--nproc={lim.max_processes}", "--"]

    def run(self, command: str) -> SandboxResult:
        if "\0" in command:
            raise ValueError("command contains a NUL byte")
        if self.isolated:
            argv = self._limits_prefix() + ["unshare", "--net", "--mount", "--pid", "--fork", "--kill-child",
                    "/bin/sh", "-c", _SETUP]
            env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "JAIL": str(self._base / "jail"),
                   "WORK": str(self.workdir), "CMD": command,
                   "SYSTEM_DIRS": " ".join(_SYSTEM_DIRS), "LAUNCHER": str(_LAUNCHER)}
            cwd = "/"
        else:
            argv = self._limits_prefix() + ["/bin/sh", "-c", command]
            env, cwd = {"PATH": "/usr/bin:/bin"}, self.workdir
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        return self._collect(proc)

    def _collect(self, proc: subprocess.Popen) -> SandboxResult:
        cap = self.limits.max_output_bytes
        deadline = time.monotonic() + self.limits.wall_seconds
        chunks, size, timed_out, truncated = [], 0, False, False
        os.set_blocking(proc.stdout.fileno(), False)
        while True:
            try:
                data = proc.stdout.read(65536)
            except BlockingIOError:
                data = None
            if data:
                chunks.append(data)
                size += len(data)
                if size > cap:
                    truncated = True
                    break
            elif data == b"":  # EOF: every writer has exited
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            if not data:
                time.sleep(0.005)
        if timed_out or truncated:
            _kill_group(proc)
        try:
            code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            code = proc.wait()
        proc.stdout.close()
        output = b"".join(chunks)[:cap].decode("utf-8", errors="replace")
        return SandboxResult(output=output, exit_code=None if (timed_out or truncated) else code,
                             timed_out=timed_out, output_truncated=truncated, isolated=self.isolated)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
