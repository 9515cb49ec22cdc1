"""Reward functions: the user's ``package.module:function`` or a built-in (``math``, ``exact``, ``code``).

A reward is called by keyword, ``fn(completion=..., answer=..., prompt=..., task=...)``, and
returns a float or a dict with ``reward`` (its other numeric keys become metrics). Calls run in
a pool of worker processes (``envs.rewards.worker``) with a per-call timeout: the user's code can
raise, loop forever or exhaust memory, and the trainer only sees a 0 with the reason counted.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from envs.rewards.builtin import BUILTINS

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


class _Worker:
    def __init__(self):
        # The project root first, then the trainer's own path: the user's module must import in
        # the worker as it does in the trainer.
        path = [_ROOT, *(p or os.getcwd() for p in sys.path)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(dict.fromkeys(path)))
        self.proc = subprocess.Popen([sys.executable, "-m", "envs.rewards.worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, start_new_session=True)

    def call(self, request: bytes, timeout: float) -> dict | None:
        """The worker's answer, or None if it took longer than ``timeout`` (then it is killed)."""
        self.proc.stdin.write(request)
        self.proc.stdin.flush()
        fd = self.proc.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            self.kill()
            return None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"reward worker exited (code {self.proc.wait()})")
        return json.loads(line)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()


class RewardPool:
    """``workers`` processes scoring calls with a ``timeout_s`` limit each; thread-safe."""

    def __init__(self, spec: str, *, workers: int = 2, timeout_s: float = 10.0):
        self.spec = check_reward_spec(spec)
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"reward pool: workers must be >= 1 and timeout > 0, got {workers}, {timeout_s}")
        self.timeout_s = timeout_s
        self._idle: queue.LifoQueue[_Worker | None] = queue.LifoQueue()
        for _ in range(workers):
            self._idle.put(None)  # started on first use
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self.closed = False

    def check(self, timeout_s: float = 60.0) -> None:
        """Import the function in a worker now: a bad name is one error line at startup."""
        worker = self._take()
        try:
            request = json.dumps({"check": self.spec})
            answer = worker.call(request.encode() + b"\n", timeout_s)
        except Exception:
            worker.kill()
            worker = None
            raise
        finally:
            self._idle.put(worker)
        if answer is None:
            raise ValueError(f"reward {self.spec!r}: importing it took over {timeout_s:.0f} s")
        if not answer["ok"]:
            raise ValueError(f"reward {self.spec!r} cannot be loaded: {answer['error']}")

    def _take(self) -> _Worker:
        worker = self._idle.get()
        if worker is None or worker.proc.poll() is not None:
            worker = _Worker()
        return worker

    def score(self, **kwargs) -> RewardResult:
        """Call the reward by keyword; an exception or a timeout scores 0 (first message logged)."""
        request = json.dumps({"fn": self.spec, "kwargs": kwargs}, default=str).encode() + b"\n"
        worker = self._take()
        t0 = time.monotonic()
        try:
            answer = worker.call(request, self.timeout_s)
        except Exception as e:  # noqa: BLE001 - a dead worker (killed for memory, ...) scores 0
            worker.kill()
            worker, answer = None, {"ok": False, "error": f"worker failed: {e}"}
        finally:
            self._idle.put(worker if worker is not None and worker.proc.returncode is None else None)
        if answer is None:
            return self._failed(f"timeout after {time.monotonic() - t0:.1f} s", timed_out=True)
        if not answer["ok"]:
            return self._failed(answer["error"])
        return RewardResult(answer["value"]["reward"], answer["value"]["metrics"])

    def _failed(self, error: str, *, timed_out: bool = False) -> RewardResult:
        kind = "timeout" if timed_out else "error"
        with self._lock:
            first = kind not in self._logged
            self._logged.add(kind)
        if first:
            log.warning("reward %s: %s (scored 0; later %ss are counted in the metrics, not logged)",
                        self.spec, error, kind)
        return RewardResult(0.0, error=error, timed_out=timed_out)

    def close(self) -> None:
        self.closed = True
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                return
            if worker is not None:
                worker.kill()


__all__ = ["BUILTINS", "RewardPool", "RewardResult", "check_reward_spec"]
