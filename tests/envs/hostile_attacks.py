"""Attacks a reward call makes on its isolation, for tests/envs/test_reward_isolation.py (through
``hostile_rewards:hostile`` with ``do: "attack"``, ``what: <name>``). Each returns metrics saying
what the attempt got: ``errno`` is 0 when the attempt succeeded, else the error number; the test
asserts the attempt failed *and* that its effect is absent (the trainer alive, no file left)."""

from __future__ import annotations

import ctypes
import os
import signal
import time

LIBC = ctypes.CDLL(None, use_errno=True)
FORGED_ANSWER = '{"id": %d, "ok": true, "value": {"reward": 0.777, "metrics": {}}}\n'
FORGED_FRAME = '{"nonce": "%s", "ok": true, "value": {"reward": 0.777, "metrics": {}}}\n'


def _errno(fn) -> int:
    """0 if ``fn()`` succeeds, else its errno (an unexpected error type is -1)."""
    try:
        fn()
    except OSError as e:
        return e.errno or -1
    return 0


def _ppid_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rpartition(")")[2].split()[1])


def _pool_processes(trainer: int) -> list[int]:
    """The trainer's reward workers, found the way an attacker would: /proc (children of the
    trainer running envs.rewards.worker). Only the trainer's own: a broken jail must not reach
    other people's tests on a shared machine."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if b"envs.rewards.worker" in f.read() and _ppid_of(int(entry)) == trainer:
                        found.append(int(entry))
            except (OSError, ValueError):
                continue
    return found


def hijack(task) -> dict:
    """Issue 44's attack: open the channel through /proc/<supervisor>/fd (and the trainer's, and
    each thread's) and write forged answers for the next request ids."""
    opened = 0
    denied = 0
    pids = [os.getppid()] if task.get("supervisor_only") else [os.getppid(), int(task["trainer"])]
    for pid in pids:
        for base in [f"/proc/{pid}/fd", *(f"/proc/{pid}/task/{t}/fd" for t in _listdir(f"/proc/{pid}/task"))]:
            try:
                fds = os.listdir(base)
            except OSError:
                denied += 1
                continue
            for fd in fds:
                try:
                    target = os.open(f"{base}/{fd}", os.O_WRONLY | os.O_NONBLOCK)
                except OSError:
                    continue
                opened += 1
                try:
                    os.write(target, "".join(FORGED_ANSWER % i for i in range(1, 50)).encode())
                except OSError:
                    pass
                os.close(target)
    return {"opened": float(opened), "denied": float(denied)}


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def kill_everyone(task) -> dict:
    """SIGKILL the trainer, the call's own supervisor and every worker of the pool; then SIGSTOP."""
    trainer = int(task["trainer"])
    targets = [trainer, os.getppid(), *_pool_processes(trainer)]
    out = {"targets": float(len(targets)), "killed": 0.0}
    for sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGTERM):
        for pid in targets:
            e = _errno(lambda p=pid, s=sig: os.kill(p, s))
            out["killed"] += e == 0
            out["errno"] = float(e)
    return out


def kill_all_visible(task) -> dict:
    """kill(-1, SIGKILL): every process this uid may signal but itself (there are none)."""
    os.kill(-1, signal.SIGKILL)
    return {"errno": 0.0}


def ptrace_supervisor(task) -> dict:
    """PTRACE_ATTACH / PTRACE_SEIZE the supervisor; read and write its /proc/<pid>/mem; read its
    environ; process_vm_readv."""
    sup = os.getppid()
    out = {}
    for name, request in (("attach", 16), ("seize", 0x4206)):
        rc = LIBC.ptrace(ctypes.c_long(request), ctypes.c_long(sup), None, None)
        out[f"ptrace_{name}"] = 0.0 if rc == 0 else float(ctypes.get_errno())
    out["mem"] = float(_errno(lambda: os.close(os.open(f"/proc/{sup}/mem", os.O_RDWR))))
    out["environ"] = float(_errno(lambda: open(f"/proc/{sup}/environ", "rb").read()))
    trainer_env = f"/proc/{int(task['trainer'])}/environ"
    out["trainer_environ"] = float(_errno(lambda: open(trainer_env, "rb").read()))
    buf = ctypes.create_string_buffer(16)

    class IoVec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    local, remote = IoVec(ctypes.addressof(buf), 16), IoVec(0x400000, 16)
    rc = LIBC.process_vm_readv(sup, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    out["vm_readv"] = 0.0 if rc >= 0 else float(ctypes.get_errno())
    return out


def become_root(task) -> dict:
    return {"setuid": float(_errno(lambda: os.setuid(0))), "setgid": float(_errno(lambda: os.setgid(0))),
            "uid": float(os.getuid()), "gid": float(os.getgid()), "groups": float(len(os.getgroups()))}


def write_trainer_cwd(task) -> dict:
    """A file in the working directory the call inherited from the trainer, and through
    /proc/<trainer>/cwd."""
    out = {"relative": float(_errno(lambda: open("pwned-by-reward", "w").close()))}
    trainer_cwd = f"/proc/{int(task['trainer'])}/cwd/pwned-by-reward-2"
    out["via_proc"] = float(_errno(lambda: open(trainer_cwd, "w").close()))
    return out


def shm_fill(task) -> dict:
    """``task["bytes"]`` written to a file in /dev/shm, 1 MiB at a time (the address space stays
    small: only the cgroup sees it)."""
    chunk = b"x" * (1 << 20)
    with open(f"/dev/shm/{task['name']}", "wb") as f:
        for _ in range(int(task["bytes"]) >> 20):
            f.write(chunk)
    return {"written": float(task["bytes"])}


def memfd_fill(task) -> dict:
    fd = os.memfd_create("hostile")
    chunk = b"x" * (1 << 20)
    for _ in range(int(task["bytes"]) >> 20):
        os.write(fd, chunk)
    return {"written": float(task["bytes"])}


def child_eats_memory(task) -> dict:
    """A forked child fills /dev/shm past the limit while the call itself returns a reward."""
    pid = os.fork()
    if pid == 0:
        try:
            shm_fill(task)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    return {}


def shm_write(task) -> dict:
    with open(f"/dev/shm/{task['name']}", "w") as f:
        f.write("secret")
    hold = task.get("hold_until")
    deadline = time.monotonic() + 10
    while hold and not os.path.exists(hold) and time.monotonic() < deadline:
        time.sleep(0.02)
    return {}


def shm_read(task) -> dict:
    def read():
        with open(f"/dev/shm/{task['name']}") as f:
            return f.read()
    return {"errno": float(_errno(read)), "entries": float(len(os.listdir("/dev/shm")))}


def escape_and_linger(task) -> dict:
    """A setsid'd grandchild that clears its death signal (and, like the daemon it is, ignores
    SIGTERM and SIGHUP) sleeps; the call tries to SIGKILL its supervisor, writes both pids and
    the kill's errno to ``pids_file``, then hangs (or returns when ``hang`` is false)."""
    r, w = os.pipe()
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            LIBC.prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG 0
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            os.write(w, str(os.getpid()).encode())
            time.sleep(300)
        os._exit(0)
    os.wait()
    grandchild = int(os.read(r, 32))
    killed = _errno(lambda: os.kill(os.getppid(), signal.SIGKILL)) if task.get("kill_supervisor") else -2
    with open(task["pids_file"] + ".tmp", "w") as f:
        f.write(f"{grandchild} {os.getpid()} {killed}")
    os.rename(task["pids_file"] + ".tmp", task["pids_file"])
    if task.get("hang"):
        time.sleep(300)
    return {"grandchild": float(grandchild)}


def namespace_escape(task) -> dict:
    """A child in a new user and pid namespace (where it has every capability), setsid'd: its pid
    (as the host sees it, through a pipe's peer credentials) goes to ``pids_file``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        LIBC.unshare(0x10000000 | 0x20000000)  # CLONE_NEWUSER | CLONE_NEWPID (may be refused)
        if os.fork() == 0:
            os.setsid()
            LIBC.prctl(1, 0, 0, 0, 0)
            time.sleep(300)
        os._exit(0)
    os.waitpid(pid, 0)
    os.close(w)
    os.close(r)
    # Its host pid: the newest process of this uid other than us.
    mine = sorted(p for p in map(int, filter(str.isdigit, os.listdir("/proc")))
                  if p != os.getpid() and _uid_of(p) == os.getuid())
    with open(task["pids_file"], "w") as f:
        f.write(" ".join(map(str, mine)))
    return {"lingering": float(len(mine))}


def _uid_of(pid: int) -> int:
    """The real uid of ``pid`` (``/proc/<pid>/status``: the directory of a process that is not
    dumpable, as a call is after its change of uid, belongs to root)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
    except (OSError, StopIteration, ValueError):
        return -1


def cgroup_escape(task) -> dict:
    """Move itself to the root cgroup of each hierarchy, and raise its own cgroup's limits."""
    out = {"moved": 0.0, "raised": 0.0}
    for line in open("/proc/self/cgroup").read().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in ("memory", "pids"):
            if c in controllers.split(","):
                root_procs = f"/sys/fs/cgroup/{c}/cgroup.procs"
                out["moved"] += _errno(lambda f=root_procs: _write(f, str(os.getpid()))) == 0
                limit, value = ("memory.limit_in_bytes", "-1") if c == "memory" else ("pids.max", "max")
                own = f"/sys/fs/cgroup/{c}{path}/{limit}"
                out["raised"] += _errno(lambda f=own, v=value: _write(f, v)) == 0
        if controllers == "":  # v2
            out["moved"] += _errno(lambda: _write("/sys/fs/cgroup/cgroup.procs", str(os.getpid()))) == 0
            out["raised"] += _errno(lambda p=path: _write(f"/sys/fs/cgroup{p}/memory.max", "max")) == 0
    return out


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def thread_bomb(task) -> dict:
    """Start sleeping threads until the kernel refuses one (each is a task: pids.max counts it as
    it counts a process; threads rather than forks, so that the test is quick)."""
    import threading

    threading.stack_size(64 * 1024)
    LIBC.mallopt(-8, 1)  # M_ARENA_MAX: no 64 MiB arena per thread (the call's RLIMIT_AS would bind first)
    stop, n = threading.Event(), 0
    for _ in range(5000):
        try:
            threading.Thread(target=stop.wait, daemon=True).start()
        except RuntimeError:
            break
        n += 1
    return {"started": float(n)}


def sysv_segment(task) -> dict:
    """A SysV shared memory segment with a known key, left behind on purpose (IPC_RMID never sent)."""
    shmid = LIBC.shmget(int(task["key"]), 16 << 20, 0o1000 | 0o666)  # IPC_CREAT
    if shmid < 0:
        return {"errno": float(ctypes.get_errno())}
    LIBC.shmat.restype = ctypes.c_void_p
    addr = LIBC.shmat(shmid, None, 0)
    ctypes.memset(addr, 1, 16 << 20)
    return {"errno": 0.0, "shmid": float(shmid)}


def lock_files(task) -> dict:
    """The uid leases' lock files (truncate one: the next holder would skip the cleanup)."""
    lock_dir = os.environ.get("MIXRL_SANDBOX_UID_LOCK_DIR", "/run/mixrl-sandbox/uids")
    return {"errno": float(_errno(lambda: os.listdir(lock_dir))),
            "own": float(_errno(lambda: open(f"{lock_dir}/{os.getuid()}.lock", "r+").truncate(0)))}


def mount_things(task) -> dict:
    return {"errno": float(_errno(lambda: _mount_tmpfs("/tmp"))),
            "shm": float(_errno(lambda: _mount_tmpfs("/dev/shm")))}


def _mount_tmpfs(path: str) -> None:
    if LIBC.mount(b"tmpfs", path.encode(), b"tmpfs", 0, None) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def forge_own_frame(task) -> dict:
    """Write a result frame with a guessed nonce on every descriptor (its own result pipe among
    them), then exit without returning."""
    for fd in range(3, 64):
        try:
            os.write(fd, (FORGED_FRAME % ("0" * 32)).encode())
        except OSError:
            pass
    os._exit(0)


def peek_other_call(task) -> dict:
    """Another call (of the other worker) is running and has written its pid to ``peer_file``:
    read its memory, environ and descriptors, signal it."""
    deadline = time.monotonic() + 10
    while not os.path.exists(task["peer_file"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    peer = int(open(task["peer_file"]).read())
    return {"mem": float(_errno(lambda: os.close(os.open(f"/proc/{peer}/mem", os.O_RDONLY)))),
            "environ": float(_errno(lambda: open(f"/proc/{peer}/environ", "rb").read())),
            "fds": float(_errno(lambda: os.listdir(f"/proc/{peer}/fd"))),
            "kill": float(_errno(lambda: os.kill(peer, signal.SIGKILL))),
            "same_uid": float(_uid_of(peer) == os.getuid())}


def wait_as_peer(task) -> dict:
    _write(task["peer_file"] + ".tmp", str(os.getpid()))
    os.rename(task["peer_file"] + ".tmp", task["peer_file"])
    deadline = time.monotonic() + 10
    while not os.path.exists(task["done_file"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    return {}


def home(task) -> dict:
    """What the call sees of the trainer's home and of the interpreter: a lazily imported standard
    module and ``sys.executable`` run as the call's uid."""
    import subprocess
    import sys

    try:
        import wave  # noqa: F401 - imported by nothing before: read from the stdlib now, as the call's uid
        lazy = 1.0
    except ImportError:
        lazy = 0.0
    ran = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True, timeout=30)
    try:
        entries = sorted(os.listdir(os.path.expanduser("~root")))
    except OSError:
        entries = None
    only_needed = entries is None or all(e in task.get("allowed", []) for e in entries)
    return {"lazy_import": lazy, "python_ran": float(ran.stdout.strip() == "42"),
            "home_entries": -1.0 if entries is None else float(len(entries)),
            "home_has_only_needed": float(only_needed), "uid": float(os.getuid()),
            "supervisor_fds": float(os.access(f"/proc/{os.getppid()}/fd", os.R_OK))}


ATTACKS = {f.__name__: f for f in (
    hijack, kill_everyone, kill_all_visible, ptrace_supervisor, become_root, write_trainer_cwd, shm_fill,
    memfd_fill, child_eats_memory, shm_write, shm_read, escape_and_linger, namespace_escape, cgroup_escape,
    thread_bomb, sysv_segment, lock_files, mount_things, forge_own_frame, peek_other_call, wait_as_peer,
    home)}
