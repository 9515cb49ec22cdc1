"""Reward functions: the user's ``package.module:function`` or a built-in (``math``, ``exact``, ``code``).

A reward is called by keyword, ``fn(completion=..., answer=..., prompt=..., task=...)``, and
returns a float or a dict with ``reward`` (its other numeric keys become metrics). Calls run in
a pool of worker processes (``envs.rewards.worker``) with a per-call timeout: the user's code can
raise, loop forever or exhaust memory, and the trainer only sees a 0 with the reason counted.
Each call (the built-ins' included) runs in a process of its own, as root under a uid of its own
in a cgroup with a private ``/dev/shm`` (``envs.rewards.call_isolation``): it reaches nothing but
its own answer. A reward or metric beyond ``max_abs_reward`` scores 0 as ``out_of_range``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import queue
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from envs.rewards.builtin import BUILTINS
from envs.rewards.call_isolation import Plan, WorkerJail, closed_paths, needed_paths, plan
from envs.rewards.limits import DEADLINE_ENV, MAX_METRICS, MAX_REQUEST_BYTES

log = logging.getLogger(__name__)
_ROOT = str(Path(__file__).resolve().parents[2])


def check_reward_spec(spec: Any) -> str:
    """``spec`` if it names a built-in or has the form ``package.module:function``, else one error line."""
    if not isinstance(spec, str) or not (spec in BUILTINS or _looks_like_target(spec)):
        raise ValueError(f"reward {spec!r}: give a built-in ({', '.join(BUILTINS)}) or "
                         "'package.module:function'")
    return spec


def _looks_like_target(spec: str) -> bool:
    module, sep, attr = spec.partition(":")
    return bool(sep) and attr.isidentifier() and all(p.isidentifier() for p in module.split("."))


@dataclasses.dataclass(frozen=True)
class RewardResult:
    reward: float
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    error: str | None = None  # the exception, or "timeout after N s"
    timed_out: bool = False
    # Why it scored 0 (a short metric name: timeout, exception, memory, crashed, exited, forked,
    # stray_output, bad_return, out_of_range, load, isolation, worker_died, protocol, too_large; a
    # built-in's own: unsupported_test, non_plain_value),
    # None when it did not fail.
    reason: str | None = None


_GRACE_S = 5.0  # how much longer than a call's timeout the pool waits for its supervisor
_LOAD_GRACE_S = 60.0  # the same, for a call that first imports the function
_MAX_ANSWER_BYTES = 1024**2
_warned: set[str] = set()  # lines this process has logged once already (one per host situation)
_warned_lock = threading.Lock()


def _warn_once(line: str) -> None:
    with _warned_lock:
        if line in _warned:
            return
        _warned.add(line)
    log.warning("%s", line)


class _WorkerFailed(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class _TooLarge(Exception):
    """The request is over ``MAX_REQUEST_BYTES``: refused before a byte of it is written (the
    worker is left as it was)."""


class _Worker:
    """One supervisor process (``envs.rewards.worker``): requests on its stdin, answers on its
    stdout, one answer per request, matched by id."""

    def __init__(self, plan: Plan, memory_bytes: int):
        # What the calls run in (a uid and a cgroup for this worker's life, where the plan has them):
        # held here, so that killing this worker kills its calls' cgroup whatever the worker did.
        self.jail = WorkerJail(plan, memory_bytes)
        # The project root first, then the trainer's own path: the user's module must import in
        # the worker as it does in the trainer.
        path = [_ROOT, *(p or os.getcwd() for p in sys.path)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(dict.fromkeys(path)))
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "envs.rewards.worker", "--jail", self.jail.argument(memory_bytes)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True)
        except BaseException:
            self.jail.release()
            raise
        # Requests are written without blocking, a slice at a time, inside the call's deadline: a
        # worker that stops reading cannot hold the caller past it (a blocking write of a request
        # over the pipe's 64 KiB did, for ever).
        os.set_blocking(self.proc.stdin.fileno(), False)
        self._write_lock = threading.Lock()  # the writer's os.write vs another thread's close
        self.loaded: set[str] = set()
        self.busy = False  # a thread is in call(): kill() then leaves its pipe to it
        self._next_id = 0
        self._buf = b""

    def call(self, request: dict, timeout: float) -> dict | None:
        """The answer to ``request``, or None if none came within ``timeout`` s, writing the request
        included (the worker is then killed); ``_WorkerFailed`` if the worker died or broke the
        protocol, ``_TooLarge`` (nothing sent) if the request is over ``MAX_REQUEST_BYTES``."""
        self.busy = True
        try:
            return self._call(request, timeout)
        finally:
            self.busy = False

    def _call(self, request: dict, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        # A fresh nonce per request, echoed in the answer: a line another process managed to put
        # on the answer pipe (a call running as the trainer's user, in the fallback) lacks it.
        nonce = secrets.token_hex(16)
        line = json.dumps({**request, "id": self._next_id + 1, "nonce": nonce}, default=str).encode()
        if len(line) > MAX_REQUEST_BYTES:
            raise _TooLarge(f"the reward request is {len(line)} bytes, over MAX_REQUEST_BYTES "
                            f"({MAX_REQUEST_BYTES}): not sent")
        self._next_id += 1
        rid = self._next_id
        unsent = memoryview(line + b"\n")  # sliced, never copied: a 64 MiB request is written once
        try:  # the pool may be closed under us: its pipes are then gone
            out_fd, in_fd = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        except ValueError:
            raise _WorkerFailed("worker_died", "reward worker stopped (its pipes are closed)") from None
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                return None
            try:
                readable, writable, _ = select.select([in_fd], [out_fd] if unsent else [], [], left)
                if writable:
                    unsent = unsent[self._write(out_fd, unsent[:1 << 20]):]
                data = os.read(in_fd, 1 << 20) if readable else None
            except BrokenPipeError:  # it stopped reading for good: its answer (if any) or EOF tells
                unsent = unsent[:0]
                continue
            except (OSError, ValueError) as e:
                raise _WorkerFailed("worker_died", f"reward worker stopped ({e})") from None
            if data is None:
                continue
            if not data:
                raise _WorkerFailed("worker_died", f"reward worker exited (code {self.proc.wait()})")
            self._buf += data
            if len(self._buf) > _MAX_ANSWER_BYTES:
                raise _WorkerFailed("protocol", "reward worker answered over 1 MiB")
        line, _, self._buf = self._buf.partition(b"\n")
        try:
            answer = json.loads(line)
        except ValueError:
            raise _WorkerFailed("protocol", f"reward worker answered {line[:60]!r}") from None
        if isinstance(answer, dict) and answer.get("id") is None and answer.get("reason") == "too_large":
            raise _WorkerFailed("too_large", str(answer.get("error")))  # the worker exits after it
        if not isinstance(answer, dict) or answer.get("id") != rid or answer.get("nonce") != nonce \
                or self._buf or unsent:
            raise _WorkerFailed("protocol", f"reward worker answered request {answer.get('id')!r} "
                                f"to request {rid}" if isinstance(answer, dict) else "not an object")
        return answer

    def _write(self, fd: int, data: memoryview) -> int:
        """Write what the pipe takes now (never blocks); not once another thread closed it."""
        with self._write_lock:
            if self.proc.stdin.closed:
                raise _WorkerFailed("worker_died", "reward worker stopped (its pipes are closed)")
            try:
                return os.write(fd, data)
            except BlockingIOError:
                return 0

    def kill(self) -> None:
        """Kill the supervisor and its process group, then its calls' cgroup and uid: nothing a
        call started survives, a setsid'd process that cleared its death signal included."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.jail.release()
        # A thread reading the answer sees EOF and closes its pipe itself (never a reused fd).
        self._close_stdin()
        if not self.busy:
            try:
                self.proc.stdout.close()
            except OSError:
                pass

    def _close_stdin(self) -> None:
        with self._write_lock:  # never between a writer's check and its os.write
            try:
                self.proc.stdin.close()
            except OSError:
                pass

    def close(self, wait_s: float = 2.0) -> None:
        """Close the channel (the supervisor kills what its calls left and exits), then kill."""
        self._close_stdin()
        try:
            self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            pass
        self.kill()


def _valid_answer(answer: dict) -> tuple[float, dict[str, float]]:
    """The reward and metrics of an ``ok`` answer, re-checked on this side of the channel."""
    value = answer.get("value")
    if not isinstance(value, dict) or not isinstance(value.get("metrics"), dict):
        raise _WorkerFailed("protocol", "reward worker answered without a reward")
    reward, metrics = value.get("reward"), value["metrics"]
    if type(reward) not in (int, float) or not math.isfinite(reward) or len(metrics) > MAX_METRICS or not all(
            isinstance(k, str) and type(v) in (int, float) and math.isfinite(v) for k, v in metrics.items()):
        raise _WorkerFailed("protocol", "reward worker answered a malformed reward")
    return float(reward), {k: float(v) for k, v in metrics.items()}


class RewardPool:
    """``workers`` processes scoring calls with a ``timeout_s`` limit each; thread-safe.

    ``memory_bytes``: the memory of each call (0 for none): its address space (``RLIMIT_AS``) and,
    as root, its cgroup's limit, which counts ``/dev/shm`` and memfd files too.
    ``max_abs_reward``: a reward or metric of larger magnitude scores 0 (``out_of_range``).
    Every call runs in a process of its own, forked from a worker that imported the function, as
    root under a uid of its own in a cgroup (``envs.rewards.call_isolation``; one warning line at
    start names what this host cannot enforce): keep a function's expensive state at module level
    (loaded once), not in a cache it fills on its first call (each call starts from the loaded
    module, not from the previous call).
    """

    def __init__(self, spec: str, *, workers: int = 2, timeout_s: float = 10.0,
                 memory_bytes: int = 4 * 1024**3, max_abs_reward: float = 1e6):
        self.spec = check_reward_spec(spec)
        if workers < 1 or timeout_s <= 0 or memory_bytes < 0:
            raise ValueError(f"reward pool: workers must be >= 1, timeout > 0 and memory >= 0, got "
                             f"{workers}, {timeout_s}, {memory_bytes}")
        if isinstance(max_abs_reward, bool) or not isinstance(max_abs_reward, int | float) \
                or not max_abs_reward > 0 or not math.isfinite(max_abs_reward):
            raise ValueError(f"reward pool: max_abs_reward must be a finite number > 0, "
                             f"got {max_abs_reward!r}")
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self.max_abs_reward = float(max_abs_reward)
        self.plan = plan()
        if (line := self.plan.warning()) is not None:
            _warn_once(line)
        if self.plan.uid and (closed := closed_paths(needed_paths())):
            _warn_once(f"reward calls run under uids of their own, which cannot read {', '.join(closed[:3])} "
                       "(closed to others): a module imported lazily, or a file opened, from there fails "
                       "in the call; open the directory to others or import at module level")
        self._idle: queue.LifoQueue[_Worker | None] = queue.LifoQueue()
        for _ in range(workers):
            self._idle.put(None)  # started on first use
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self._all: set[_Worker] = set()
        self.closed = False

    def check(self, timeout_s: float = 60.0) -> None:
        """Import the function in a worker now: a bad name is one error line at startup."""
        try:
            worker = self._take()
        except _WorkerFailed as e:
            raise ValueError(f"reward {self.spec!r} cannot be loaded: {e}") from None
        try:
            answer = worker.call({"check": self.spec}, timeout_s)
        except _WorkerFailed as e:
            self._drop(worker)
            worker = None
            raise ValueError(f"reward {self.spec!r} cannot be loaded: {e}") from None
        finally:
            self._idle.put(worker)
        if answer is None:
            raise ValueError(f"reward {self.spec!r}: importing it took over {timeout_s:.0f} s")
        if not answer["ok"]:
            raise ValueError(f"reward {self.spec!r} cannot be loaded: {answer['error']}")
        worker.loaded.add(self.spec)

    def _take(self) -> _Worker:
        """An idle worker, started if need be; ``_WorkerFailed`` (reason ``isolation``, the slot
        given back) when its uid or cgroup cannot be had."""
        worker = self._idle.get()
        if worker is None or worker.proc.poll() is not None:
            if worker is not None:
                self._drop(worker)
            try:
                worker = _Worker(self.plan, self.memory_bytes)
            except (OSError, RuntimeError, ValueError) as e:  # CgroupError, UidsExhausted, a bad range
                self._idle.put(None)
                raise _WorkerFailed("isolation", f"cannot start a reward worker's isolation: {e}") from None
            with self._lock:
                self._all.add(worker)
            if self.closed:  # closed meanwhile: never leave a process behind
                self._drop(worker)
                self._idle.put(None)
                raise RuntimeError("reward pool is closed")
        return worker

    def _drop(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            self._all.discard(worker)

    def score(self, **kwargs) -> RewardResult:
        """Call the reward by keyword; any failure scores 0 with a reason (first message logged)."""
        request = {"fn": self.spec, "kwargs": kwargs, "timeout_s": self.timeout_s,
                   "memory_bytes": self.memory_bytes}
        try:
            worker = self._take()
        except _WorkerFailed as e:
            return self._failed(e.reason, str(e))
        grace = _GRACE_S if self.spec in worker.loaded else _LOAD_GRACE_S
        t0 = time.monotonic()
        try:
            answer = worker.call(request, self.timeout_s + grace)
            if answer is None:
                self._drop(worker)
                worker = None
                return self._failed("timeout", f"timeout after {time.monotonic() - t0:.1f} s (worker killed)")
            worker.loaded.add(self.spec)
            if not answer.get("ok"):
                reason = answer.get("reason") if isinstance(answer.get("reason"), str) else "protocol"
                return self._failed(reason, str(answer.get("error")))
            reward, metrics = _valid_answer(answer)
            big = [(k, v) for k, v in [("reward", reward), *metrics.items()] if abs(v) > self.max_abs_reward]
            if big:
                name, value = big[0]
                return self._failed("out_of_range", f"the reward function returned {name} = {value:g}, "
                                    f"beyond max_abs_reward ({self.max_abs_reward:g})")
            return RewardResult(reward, metrics)
        except _TooLarge as e:  # nothing was sent: the worker serves on
            return self._failed("too_large", str(e))
        except _WorkerFailed as e:  # a dead or confused worker scores 0 and is replaced
            self._drop(worker)
            worker = None
            return self._failed(e.reason, str(e))
        finally:
            self._idle.put(worker)

    def _failed(self, reason: str, error: str) -> RewardResult:
        timed_out = reason == "timeout"
        with self._lock:
            first = reason not in self._logged
            self._logged.add(reason)
        if first:
            log.warning("reward %s: %s (%s; scored 0; later ones are counted in the metrics, not logged)",
                        self.spec, error, reason)
        return RewardResult(0.0, error=error, timed_out=timed_out, reason=reason)

    def close(self) -> None:
        """Stop every worker (and whatever its calls started); idempotent."""
        self.closed = True
        with self._lock:
            workers = list(self._all)
            self._all.clear()
        for worker in workers:
            worker.close()


__all__ = ["BUILTINS", "DEADLINE_ENV", "MAX_METRICS", "MAX_REQUEST_BYTES", "RewardPool", "RewardResult",
           "check_reward_spec"]
