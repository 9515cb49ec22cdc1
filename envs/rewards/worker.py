"""A reward worker process: ``python -m envs.rewards.worker``.

The pool (``envs.rewards.RewardPool``) writes one JSON request per line on the worker's stdin,
``{"id": n, "fn": "package.module:function", "kwargs": {...}, "timeout_s": t, "memory_bytes": m}``
(or ``{"id": n, "check": spec}`` to import only), and reads exactly one answer line per request,
``{"id": n, "ok": true, "value": {"reward": r, "metrics": {...}}}`` or
``{"id": n, "ok": false, "reason": "...", "error": "..."}``; a request's ``nonce`` (the pool makes
one per request) comes back in its answer. A request line over ``MAX_REQUEST_BYTES``
is answered ``{"id": null, "ok": false, "reason": "too_large", ...}`` before the rest of it is read,
and the worker exits (the pool checks the size before it writes, so it never sends one).

Why every call runs in a child forked for it, not in this process: the reward function, the
built-ins included, grades model output, which is hostile. Run in the process that holds the
channel to the pool, a function that forks returns twice (two answers for one request: every
later reward lands on the wrong completion), one that writes to an inherited descriptor can answer
requests it was never asked, and a parser tricked into running code owns the channel. So this
process only imports the function (once: the children inherit the loaded module) and supervises.
It is not dumpable (``PR_SET_DUMPABLE`` 0): a call cannot open ``/proc/<this>/fd/*`` (the channel),
read its memory or ptrace it, even as the same user. The child it forks per call

- runs in what the pool set up for this worker (``envs.rewards.call_isolation``; as root): its own
  uid, a memory + pids cgroup (``memory_bytes`` counts shmem and memfd there), a private
  ``/dev/shm`` and IPC namespace, ``no_new_privs``. A different uid cannot signal the trainer or
  the workers, nor leave the cgroup. The built-in ``code`` keeps root (``ROOT_CALLS``): it starts
  the namespace sandbox, which needs root, and runs only our harness; the reply runs in the jail;
- holds no descriptor of the channel: everything but stdin (``/dev/null``), stdout/stderr (the
  worker's stderr) and a fresh result pipe is closed before the function runs;
- has an address-space limit (``memory_bytes``, ``RLIMIT_AS``): a 20 GB allocation is a
  ``MemoryError`` (reason ``memory``), not the host's OOM killer; an OOM kill in its cgroup is
  ``memory`` too;
- dies with this process (``PR_SET_PDEATHSIG``), and everything it starts is killed when the call
  ends: its cgroup is killed, and this process is a child subreaper, so orphaned descendants become
  its children and are killed until none is left (a ``setsid`` does not escape);
- reports on the pipe, one line per process that returns from the function, each carrying the
  call's random nonce: a forked copy that returns is reported as ``forked`` (the caller waits for
  the copies it forked with ``os.fork`` before it answers, so the report is never lost to a race),
  and anything on the pipe but exactly one well-formed line with the nonce is ``stray_output``.

The supervisor enforces ``timeout_s`` itself (``timeout``) and re-validates the value (a finite
float reward, at most ``MAX_METRICS`` finite metrics, the line at most ``MAX_RESULT_BYTES``) before
it answers; a value that is not finite is ``out_of_range``. A child that dies without answering is
``crashed`` (a signal: a segfault, a kill) or ``exited`` (``os._exit`` without returning). The
module's import-time code is the one thing that runs here, once, as configuration
(``RewardPool.check`` does it at startup). Without root (or with ``MIXRL_REWARD_ISOLATION=fork``)
there is no uid, cgroup or namespace; then a ``setsid``'d grandchild that clears its death signal
outlives a worker killed with SIGKILL mid-call (the pool does that only if this supervisor itself
stops answering).
"""

from __future__ import annotations

import ctypes
import importlib
import json
import math
import os
import resource
import secrets
import select
import signal
import sys
import time
from collections.abc import Callable

from envs.rewards.builtin import BUILTINS, WARM
from envs.rewards.call_isolation import CallJail, IsolationError
from envs.rewards.errors import RewardError
from envs.rewards.limits import DEADLINE_ENV, MAX_METRICS, MAX_REQUEST_BYTES

MAX_RESULT_BYTES = 64 * 1024
MAX_KEY_CHARS = 100
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 1, 4, 36
# Calls that keep root in their child: ``code`` starts the namespace sandbox (root only) and runs
# only our harness there; the reply's code runs in the jail as the sandbox's uid.
ROOT_CALLS = ("code", BUILTINS["code"])
# What the built-ins' calls keep of the worker's environment: they need no API key of the
# trainer's, so a reply that subverted one reads none (the jail's settings are MIXRL_*). A
# function of your own keeps the whole environment (a judge may need its key).
BUILTIN_ENV = ("PATH", "LANG", "LC_ALL", "TMPDIR")


def builtin_environment(environ: dict[str, str]) -> dict[str, str]:
    """The part of ``environ`` a built-in's call keeps."""
    return {k: v for k, v in environ.items() if k in BUILTIN_ENV or k.startswith("MIXRL_")}
TERM_GRACE_S = 1.0


def resolve(spec: str) -> Callable:
    """The function a reward spec names: a built-in name or ``package.module:function``; the
    built-ins' heavy imports (sympy) happen here, once, not in every call's child."""
    target = BUILTINS.get(spec, spec)
    module_name, _, attr = target.partition(":")
    fn = getattr(importlib.import_module(module_name), attr, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {module_name} has no function {attr!r}")
    for name in WARM.get(spec, ()):
        importlib.import_module(name)
    return fn


class OutOfRange(ValueError):
    """A reward or metric that is not a finite float (NaN, inf, an int past float's range)."""


def _finite(name: str, value) -> float:
    try:
        number = float(value)
    except OverflowError:
        raise OutOfRange(f"reward function returned {name} = an int of {len(str(value))} digits") from None
    if not math.isfinite(number):
        raise OutOfRange(f"reward function returned {name} = {number}")
    return number


def normalise(value) -> dict:
    """``{"reward": float, "metrics": {name: float}}`` from a float or a dict with ``reward``;
    ``OutOfRange`` for a value that is not finite, ValueError/TypeError for anything else (text, a
    dict without ``reward`` or too large)."""
    metrics = {}
    if isinstance(value, dict):
        if "reward" not in value:
            keys = sorted(map(str, value))[:8]
            raise ValueError(f"reward function returned a dict without 'reward' (keys {keys})")
        if len(value) > MAX_METRICS + 1:
            raise ValueError(f"reward function returned a dict of {len(value)} keys "
                             f"(at most {MAX_METRICS + 1})")
        metrics = {str(k): v for k, v in value.items()
                   if k != "reward" and isinstance(v, int | float) and not isinstance(v, bool)}
        if any(len(k) > MAX_KEY_CHARS for k in metrics):
            raise ValueError(f"reward function returned a metric name over {MAX_KEY_CHARS} characters")
        metrics = {k: _finite(f"metric {k!r}", v) for k, v in metrics.items()}
        value = value["reward"]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"reward function returned {type(value).__name__}, not a float")
    return {"reward": _finite("reward", value), "metrics": metrics}


def _prctl(option: int, arg: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the pool's process-group kill still applies
        pass


def _error(reason: str, error: str) -> dict:
    return {"ok": False, "reason": reason, "error": error[:500]}


# ---------------------------------------------------------------- the call's child


def _report(fd: int, frame: dict) -> None:
    data = (json.dumps(frame) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def _terminate(signum, frame):
    raise SystemExit(f"the call ran past its timeout (signal {signum})")


def _child(fn: Callable, kwargs: dict, out: int, memory_bytes: int, supervisor: int,
           timeout_s: float, nonce: str, jail: CallJail, spec: str) -> None:
    """Run the function once and report on ``out``; never returns (``os._exit``)."""
    try:
        if spec in BUILTINS or spec in BUILTINS.values():
            kept = builtin_environment(dict(os.environ))
            os.environ.clear()
            os.environ.update(kept)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != supervisor:  # the supervisor died before the death signal was set
            os._exit(1)
        # At the timeout the supervisor sends SIGTERM first: the call unwinds (a sandbox's close()
        # runs) before the SIGKILL; and a reward that starts a sandbox can fit it in the time left.
        signal.signal(signal.SIGTERM, _terminate)
        os.environ[DEADLINE_ENV] = repr(time.time() + timeout_s)
        os.closerange(3, out)
        os.closerange(out + 1, os.sysconf("SC_OPEN_MAX"))
        try:
            jail.enter(keep_root=spec in ROOT_CALLS)
        except IsolationError as e:
            _report(out, {"nonce": nonce, **_error("isolation", f"the call's isolation failed: {e}")})
            os._exit(0)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # a change of uid cleared it
        if os.getppid() != supervisor:
            os._exit(1)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file of a crash in the trainer's cwd
        if memory_bytes:
            resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        me, forked, real_fork = os.getpid(), [], os.fork

        def fork() -> int:  # remember the copies the function forks, to wait for them below
            pid = real_fork()
            if pid:
                forked.append(pid)
            return pid

        os.fork = fork
        try:
            value = fn(**kwargs)
        except MemoryError:
            value, frame = None, _error("memory", "MemoryError: the call exceeded its memory limit")
        except BaseException as e:  # noqa: BLE001 - SystemExit from the user's code scores 0 too
            # A built-in's refusal names its own reason (code: unsupported_test, non_plain_value).
            reason = e.reason if isinstance(e, RewardError) else "exception"
            value, frame = None, _error(reason, f"{type(e).__name__}: {e}")
        else:
            frame = None
        if os.getpid() != me:  # a copy the function forked returned from it
            _report(out, {"nonce": nonce, "forked": True})
            os._exit(0)
        for pid in forked:  # wait for the copies it forked: a returning one reports before we answer
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:  # the function reaped it itself
                pass
        if frame is None:
            try:
                frame = {"ok": True, "value": normalise(value)}
            except OutOfRange as e:
                frame = _error("out_of_range", str(e))
            except (TypeError, ValueError) as e:
                frame = _error("bad_return", f"{type(e).__name__}: {e}")
        _report(out, {"nonce": nonce, **frame})
    finally:
        os._exit(0)


# ---------------------------------------------------------------- the supervisor


def _children(pid: int) -> list[int]:
    """The children of every thread of ``pid`` (an orphan is reparented to any thread of a
    subreaper: the user module may have started threads here at import)."""
    try:
        found = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(x) for x in f.read().split()]
        return found
    except OSError:
        found = []
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rpartition(")")[2].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
        return found


def _stop(pid: int) -> int:
    """SIGTERM, up to ``TERM_GRACE_S`` to unwind, then SIGKILL; the call's wait status."""
    try:
        os.kill(pid, signal.SIGTERM)
        pidfd = os.pidfd_open(pid)
        try:
            select.select([pidfd], [], [], TERM_GRACE_S)
        finally:
            os.close(pidfd)
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return os.waitpid(pid, 0)[1]


def kill_descendants() -> None:
    """Kill and reap every process below this one (orphans are reparented here: subreaper)."""
    me = os.getpid()
    for _ in range(10_000):
        kids = _children(me)
        if not kids:
            break
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in kids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG) == (0, 0):
                break
        except ChildProcessError:
            break


class Supervisor:
    """This process's side: the channel to the pool and the calls' children."""

    def __init__(self, jail: CallJail | None = None):
        # Not dumpable: /proc/<this>/fd (the channel), /proc/<this>/mem and ptrace are closed to
        # the calls, even to one running as this user (the fallback without a uid of its own).
        _prctl(PR_SET_DUMPABLE, 0)
        self.jail = jail or CallJail()
        self.channel_in = os.dup(0)
        self.channel_out = os.dup(1)
        os.set_inheritable(self.channel_in, False)
        os.set_inheritable(self.channel_out, False)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.dup2(2, 1)  # the user's prints land on stderr, never on the channel
        sys.stdout = sys.stderr
        self.pending = bytearray()  # bytes read past the last request line
        self.functions: dict[str, Callable] = {}
        _prctl(PR_SET_CHILD_SUBREAPER, 1)

    def requests(self):
        """Request dicts as they arrive; ends when the pool closes the channel (or dies), or after
        a line over ``MAX_REQUEST_BYTES`` (answered ``too_large`` with id null; the rest of it is
        never read, so memory stays bounded whatever the writer sends)."""
        while True:
            line = self._next_line()
            if line is None:
                return
            yield json.loads(line)

    def _next_line(self) -> bytes | None:
        """The next request line, read in linear time: each byte is appended once (a bytearray
        grows in place) and searched once (from where the last search stopped); None at EOF or
        after refusing a line over the limit. ``pending`` never holds more than the limit + 1
        bytes of an unfinished line (the reads are sized to stop there)."""
        scanned = 0
        while True:
            end = self.pending.find(b"\n", scanned)
            if end > MAX_REQUEST_BYTES or (end < 0 and len(self.pending) > MAX_REQUEST_BYTES):
                self.answer({"id": None, **_error(
                    "too_large", f"a request line over MAX_REQUEST_BYTES ({MAX_REQUEST_BYTES} bytes): "
                    "refused unread; the worker exits")})
                return None
            if end >= 0:
                line = bytes(self.pending[:end])
                del self.pending[:end + 1]  # O(1): a bytearray drops its head by moving its start
                return line
            scanned = len(self.pending)
            data = os.read(self.channel_in, min(1 << 20, MAX_REQUEST_BYTES + 1 - scanned))
            if not data:
                return None
            self.pending += data

    def answer(self, answer: dict) -> None:
        data = (json.dumps(answer) + "\n").encode()
        while data:
            data = data[os.write(self.channel_out, data):]

    def call(self, fn: Callable, kwargs: dict, timeout_s: float, memory_bytes: int, spec: str = "") -> dict:
        """One call of ``fn`` in a child forked for it (``spec`` names it: the built-ins' calls run
        with a reduced environment, ``code``'s keeps root)."""
        nonce = secrets.token_hex(16)  # made now: the child of an earlier call never saw it
        ooms = self.jail.oom_kills()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _child(fn, kwargs, w, memory_bytes, os.getppid(), timeout_s, nonce, self.jail, spec)
        os.close(w)
        try:
            answer = self._collect(pid, r, timeout_s, nonce)
        finally:
            os.close(r)
        if self.jail.oom_kills() > ooms and answer.get("reason") != "timeout":
            # The kernel killed a process of the call for the cgroup's limit: whatever the call
            # answered (a child of it may have been the one killed), it ran out of memory.
            return _error("memory", f"the call's cgroup hit its memory limit ({memory_bytes} bytes: "
                          "memory, /dev/shm and memfd files together); the kernel killed it")
        return answer

    def _collect(self, pid: int, r: int, timeout_s: float, nonce: str) -> dict:
        deadline = time.monotonic() + timeout_s
        pidfd = os.pidfd_open(pid)
        buf, status, outcome, eof = bytearray(), None, None, False
        try:
            while outcome is None and status is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    outcome = _error("timeout", f"timeout after {timeout_s:.1f} s")
                    break
                # The channel is watched for EOF (the pool gone); never past the request limit.
                channel = [self.channel_in] if len(self.pending) <= MAX_REQUEST_BYTES else []
                ready, _, _ = select.select([pidfd, *channel] + ([] if eof else [r]), [], [], left)
                if self.channel_in in ready:
                    data = os.read(self.channel_in, 1 << 20)
                    if not data:  # the pool is gone: take the call down with us
                        self.jail.clear()
                        kill_descendants()
                        os._exit(0)
                    self.pending += data
                if r in ready:
                    data = os.read(r, 65536)
                    eof = not data
                    buf += data
                    if len(buf) > MAX_RESULT_BYTES:
                        outcome = _error("stray_output", f"over {MAX_RESULT_BYTES} bytes on the result pipe")
                if pidfd in ready:
                    status = os.waitpid(pid, 0)[1]
        finally:
            os.close(pidfd)
        if status is None:
            status = _stop(pid)
        self.jail.clear()  # the call's cgroup: whatever session or process group it moved to
        kill_descendants()  # nothing the call started survives it; every writer of r is gone
        while outcome is None and len(buf) <= MAX_RESULT_BYTES:
            data = os.read(r, 65536)
            if not data:
                break
            buf += data
        if outcome is not None:
            return outcome
        if len(buf) > MAX_RESULT_BYTES:
            return _error("stray_output", f"over {MAX_RESULT_BYTES} bytes on the result pipe")
        return _verdict(bytes(buf), status, nonce)


def _verdict(data: bytes, status: int, nonce: str) -> dict:
    """The answer the call's pipe and exit status amount to (see the module docstring)."""
    frames = []
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            frame = json.loads(line)
        except ValueError:
            return _error("stray_output", f"unexpected bytes on the result pipe: {line[:60]!r}")
        if not isinstance(frame, dict):
            return _error("stray_output", f"unexpected data on the result pipe: {line[:60]!r}")
        if frame.pop("nonce", None) != nonce:  # written by something other than this call's child
            return _error("stray_output", f"a result without the call's nonce: {line[:60]!r}")
        frames.append(frame)
    if any(f.get("forked") for f in frames):
        return _error("forked", "a process the reward function forked returned from it "
                      "(one call, two answers)")
    if not frames:
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            return _error("crashed", f"the call died of signal {sig} ({signal.Signals(sig).name})")
        code = os.waitstatus_to_exitcode(status)
        return _error("exited", f"the call exited with code {code} without a result")
    if len(frames) > 1:
        return _error("stray_output", f"{len(frames)} results for one call")
    frame = frames[0]
    if frame.get("ok") is True:
        value = frame.get("value")
        try:
            if not isinstance(value, dict) or not isinstance(value.get("metrics"), dict):
                raise TypeError("not a reward/metrics pair")
            return {"ok": True, "value": normalise({**value["metrics"], "reward": value["reward"]})}
        except OutOfRange as e:
            return _error("out_of_range", str(e))
        except (TypeError, ValueError, KeyError) as e:
            return _error("stray_output", f"a malformed result on the result pipe ({e})")
    if frame.get("ok") is False and isinstance(frame.get("reason"), str) \
            and isinstance(frame.get("error"), str):
        return _error(frame["reason"][:40], frame["error"])
    return _error("stray_output", "a malformed result on the result pipe")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    jail = CallJail.from_argument(argv[1] if argv[:1] == ["--jail"] and len(argv) > 1 else None)
    sup = Supervisor(jail)
    for request in sup.requests():
        rid = request.get("id") if isinstance(request, dict) else None
        try:
            if "check" in request:  # load the function only (RewardPool.check)
                sup.functions[request["check"]] = resolve(request["check"])
                answer = {"ok": True, "value": None}
            else:
                spec = request["fn"]
                if spec not in sup.functions:
                    sup.functions[spec] = resolve(spec)
                answer = sup.call(sup.functions[spec], request.get("kwargs", {}), float(request["timeout_s"]),
                                  int(request.get("memory_bytes") or 0), spec=spec)
        except Exception as e:  # noqa: BLE001 - an import failure is the request's error, not ours
            answer = _error("load", f"{type(e).__name__}: {e}")
        # The pool's per-request nonce goes back with the answer: a line that some other process
        # put on the pool's pipe cannot carry it.
        nonce = request.get("nonce") if isinstance(request, dict) else None
        sup.answer({"id": rid, **({"nonce": nonce} if nonce is not None else {}), **answer})
    kill_descendants()
    sup.jail.clear()


if __name__ == "__main__":
    main()
