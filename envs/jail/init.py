"""The sandbox's init: pid 1 of the jail's pid namespace. ``python3 -I -S init.py PARENT_FD``.

Runs as root under the host's system Python (standard library only), started by ``unshare --fork
--kill-child`` inside fresh mount, pid, network, IPC and UTS namespaces and the sandbox's cgroups.
It builds the jail (a read-only tmpfs root holding read-only binds of the system directories, the
episode's size-limited ``/work``, ``/dev/null`` and a private ``/proc``), then forks the command,
which chroots, drops to the sandbox's uid with no capabilities and ``no_new_privs``, installs the
seccomp filter and execs ``/bin/sh -c CMD``.

Why a separate init rather than the command as pid 1: the command (or whatever it execs) can leave
its process group and session, and its kill-on-parent-death signal is cleared when its uid changes;
init stays root, so the signal set by ``--kill-child`` holds, and it

- reaps orphans (the command's background jobs) while the command runs;
- exits with the command's status when the command exits: the kernel then kills every process left
  in the namespace, so nothing outlives the run;
- exits when the sandbox's owner dies: it holds the read end of a pipe whose only writer is the
  owner, and end-of-file on it means the owner is gone (even by SIGKILL).

Environment: ``JAIL``, ``WORK``, ``CMD``, ``SYSTEM_DIRS``, ``LAUNCHER``, ``SANDBOX_UID``.
"""

import os
import select
import signal
import sys

SETUP = r"""
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
"""


def _command_argv(env: dict) -> list[str]:
    uid = env["SANDBOX_UID"]
    return ["chroot", env["JAIL"], "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
            "--no-new-privs", "--inh-caps=-all", "--bounding-set=-all", "--",
            "/usr/bin/python3", "-I", "-S", "/.mixrl/seccomp_launch.py",
            "/bin/sh", "-c", 'cd /work && exec /bin/sh -c "$0"', env["CMD"]]


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell reports it


def main() -> None:
    # Standard library modules that import fast only: init's start-up is paid on every run.
    parent_fd = int(sys.argv[1])
    env = dict(os.environ)
    setup = os.fork()
    if setup == 0:
        try:
            os.execve("/bin/sh", ["sh", "-c", SETUP], env)
        finally:
            os._exit(127)
    if os.waitpid(setup, 0)[1] != 0:
        print("sandbox: the jail could not be built", file=sys.stderr, flush=True)
        os._exit(125)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    child = os.fork()
    if child == 0:
        try:
            os.close(parent_fd)
            os.execvpe("chroot", _command_argv(env), {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin"})
        finally:
            os._exit(127)
    while True:
        ready, _, _ = select.select([parent_fd, wake_r], [], [])
        if parent_fd in ready:  # the owner closed its end or died: end the namespace now
            os.kill(-1, signal.SIGKILL)
            os._exit(137)
        try:
            os.read(wake_r, 4096)
        except BlockingIOError:
            pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                pid = 0
            if pid == 0:
                break
            if pid == child:  # exiting kills everything left in the namespace
                os._exit(_exit_code(status))


if __name__ == "__main__":
    main()
