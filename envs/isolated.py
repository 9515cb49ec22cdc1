"""Outside environments run in worker processes: their failures end an episode, never a sampler.

An environment named by import path or entry point (``envs.loading``) is user code. On a sampler
``build_env`` wraps it in ``IsolatedEnvironment``: each episode runs in a worker process of its own
(``envs.isolated_worker``, kept and reused for later episodes), and every ``start`` / ``step`` is
one request with the entry's ``options.timeout_s`` (default ``envs.loading.DEFAULT_TIMEOUT_S``).
What would otherwise take the sampler down or poison a trajectory ends the episode with reward 0,
termination ``error``, and one reason counted (``Episode.note_error`` -> ``finish_reason`` -> the
trainer's ``env/<name>/errors/<reason>``):

- ``exception``: ``start`` or ``step`` raised (in the worker);
- ``timeout``: a call ran past ``timeout_s`` (its worker is killed with its process group);
- ``crashed``: the worker died (a segfault, ``os._exit``), or broke the line protocol (``protocol``);
- ``bad_output``: ``step`` returned no ``StepResult``, or a prompt / stop tokens that are not token
  ids; ``bad_observation``: an observation that is not a list of ids of the tokenizer's
  vocabulary; ``bad_reward``: a reward that is no finite number; ``bad_done``: ``done`` not a bool
  (or a ``termination`` mixrl does not know).

The reasons the environment counts itself (``note_error`` in its episode) are carried over too. A
``start`` that fails raises ``EnvCallFailed``: the sampler then runs one turn from the task's
prompt and ends it with that reason (``failed_episode``), so the sample is still counted.
Drawing tasks and demonstrations (``sample_task``, ``demonstration``) run in this process: they are
the trainer's side, where the environment is configuration.
"""

from __future__ import annotations

import json
import logging
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from convert.tokenizer import source_dir
from envs.base import ENVIRONMENTS, TERMINATIONS, Environment, Episode, StepResult, Task
from envs.loading import make_env, resolve_env, timeout_s
from mixrl_wire.reward_parts import clean as clean_reward_parts

log = logging.getLogger("mixrl.envs")
_ROOT = str(Path(__file__).resolve().parents[1])
#: How long a worker may take to start, import the class and build the environment.
INIT_TIMEOUT_S = 120.0
_MAX_ANSWER_BYTES = 64 * 1024**2
_REASON_CHARS = 40


class EnvCallFailed(Exception):
    """A call of an outside environment failed; ``reason`` is the counted metric name."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class _Worker:
    """One ``envs.isolated_worker`` process: a request per line in, an answer per line out."""

    def __init__(self, init: dict):
        path = [_ROOT, *(p or os.getcwd() for p in sys.path)]  # the user's module imports as here
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(dict.fromkeys(path)))
        self.proc = subprocess.Popen([sys.executable, "-m", "envs.isolated_worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                     start_new_session=True)
        self._buf = b""
        self.killed = False
        self.call(init, INIT_TIMEOUT_S)

    def call(self, request: dict, timeout: float) -> dict:
        """The ``ok`` answer to ``request``; ``EnvCallFailed`` otherwise (the worker is killed
        unless it answered the failure itself)."""
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError) as e:
            self.kill()
            raise EnvCallFailed("crashed", f"the environment's worker is gone ({e})") from None
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            ready = select.select([fd], [], [], max(0.0, left))[0] if left > 0 else []
            if not ready:
                self.kill()
                raise EnvCallFailed("timeout", f"{request['op']} took over {timeout:g} s")
            data = os.read(fd, 1 << 20)
            if not data:
                code = self.proc.wait()
                self.kill()
                raise EnvCallFailed("crashed", f"the environment's worker exited (code {code}) "
                                    f"during {request['op']}")
            self._buf += data
            if len(self._buf) > _MAX_ANSWER_BYTES:
                self.kill()
                raise EnvCallFailed("protocol", "the environment's worker answered over 64 MiB")
        line, _, self._buf = self._buf.partition(b"\n")
        try:
            answer = json.loads(line)
            ok = answer["ok"]
        except (ValueError, KeyError, TypeError):
            self.kill()
            raise EnvCallFailed("protocol", f"the environment's worker answered {line[:80]!r}") from None
        if ok is not True:
            reason = answer.get("reason")
            reason = reason if isinstance(reason, str) and reason.isidentifier() else "exception"
            raise EnvCallFailed(reason[:_REASON_CHARS], str(answer.get("error"))[:500])
        return answer

    @property
    def alive(self) -> bool:
        return not self.killed and self.proc.poll() is None

    def kill(self) -> None:
        """Kill the worker and its process group (whatever the environment started); once (a
        reaped worker's group id may be reused)."""
        if self.killed:
            return
        self.killed = True
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


def _ids(value: Any, vocab: int) -> list[int] | None:
    """``value`` as token ids of a ``vocab``-sized vocabulary, else None."""
    if not isinstance(value, list) or not all(type(t) is int and 0 <= t < vocab for t in value):
        return None
    return value


def _counts(value: Any) -> dict[str, int]:
    """The environment's own ``note_error`` counts from an answer (anything malformed dropped)."""
    if not isinstance(value, dict):
        return {}
    return {k: v for k, v in value.items() if isinstance(k, str) and k.isidentifier()
            and len(k) <= _REASON_CHARS and type(v) is int and v > 0}


class IsolatedEpisode(Episode):
    """An episode of an outside environment, stepped in its worker process."""

    def __init__(self, env: IsolatedEnvironment, worker: _Worker, prompt: list[int],
                 stop: list[int], errors: dict[str, int]):
        self.env, self._worker = env, worker
        self.prompt, self.stop_token_ids = prompt, tuple(stop)
        self._inner: dict[str, int] = errors
        self._parts: dict[str, float] = {}
        self.wants_logprobs, self.turn_logprobs = False, None  # set by start / the episode driver

    @property
    def reward_parts(self) -> dict[str, float]:
        return dict(self._parts)

    @property
    def errors(self) -> dict[str, int]:
        out = dict(self._inner)
        for reason, n in super().errors.items():
            out[reason] = out.get(reason, 0) + n
        return out

    def _end(self, reason: str, message: str) -> StepResult:
        self.note_error(reason)
        self.env.log_failure(reason, message)
        return StepResult([], 0.0, True, "error")

    def step(self, generated: list[int]) -> StepResult:
        if self._worker is None:
            return self._end("closed", "step after the episode ended")
        request = {"op": "step", "generated": [int(t) for t in generated]}
        if self.turn_logprobs is not None:
            request["logprobs"], self.turn_logprobs = list(self.turn_logprobs), None
        try:
            a = self._worker.call(request, self.env.timeout_s)
        except EnvCallFailed as e:
            if not self._worker.alive:  # killed (timeout) or dead: forgotten, never reused
                self.env.give_back(self._worker)
                self._worker = None
            return self._end(e.reason, str(e))
        self._inner = _counts(a.get("errors"))
        self._parts = clean_reward_parts(a.get("reward_parts"))
        observation, reward, done, termination = (a.get("observation"), a.get("reward"),
                                                  a.get("done"), a.get("termination"))
        if type(done) is not bool or (done and termination not in TERMINATIONS):
            return self._end("bad_done", f"step returned done={done!r}, termination={termination!r}")
        if type(reward) not in (int, float) or not math.isfinite(reward):
            return self._end("bad_reward", f"step returned reward {reward!r}")
        ids = _ids(observation, self.env.vocab_size)
        if ids is None:
            return self._end("bad_observation", f"step returned observation {str(observation)[:80]} "
                             f"(token ids below {self.env.vocab_size} wanted)")
        return StepResult(ids, float(reward), done, termination if done else None)

    def close(self) -> None:
        worker, self._worker = self._worker, None
        if worker is None:
            return
        try:
            worker.call({"op": "close"}, self.env.timeout_s)
        except EnvCallFailed as e:
            log.warning("environment %s: closing an episode failed (%s: %s)", self.env.name,
                        e.reason, e)
            worker.kill()
            return
        self.env.give_back(worker)


class _FailedStart(Episode):
    """The stand-in of an episode whose ``start`` failed: one policy turn from the task's prompt,
    then the end, with the reason counted."""

    def __init__(self, prompt: list[int], stop: tuple[int, ...], reason: str):
        self.prompt, self.stop_token_ids = list(prompt), tuple(stop)
        self.note_error(reason)

    def step(self, generated: list[int]) -> StepResult:
        return StepResult([], 0.0, True, "error")


def failed_episode(prompt: list[int], stop: tuple[int, ...], reason: str) -> Episode:
    """What the sampler runs for a task whose outside environment failed to ``start``."""
    return _FailedStart(prompt, stop, reason)


class IsolatedEnvironment(Environment):
    """``spec`` (an outside environment) with episodes in worker processes; see the module doc."""

    def __init__(self, spec: str, tokenizer: Tokenizer, difficulty: int = 1,
                 options: dict[str, Any] | None = None):
        self.cls = resolve_env(spec)
        self.name, self.single_turn = self.cls.name, self.cls.single_turn
        super().__init__(tokenizer, difficulty)
        self.spec, self.options = spec, dict(options or {})
        self.timeout_s = timeout_s(spec, self.options)
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self._local: Environment | None = None
        self._tokenizer_json = tokenizer.to_str()
        self.closed = False
        try:  # one worker now: an environment that cannot be built there is one line here
            self.give_back(self._new_worker())
        except EnvCallFailed as e:
            raise RuntimeError(f"environment {spec!r} cannot be built in a worker process "
                               f"({e.reason}: {e})") from None

    def _new_worker(self) -> _Worker:
        worker = _Worker({"op": "init", "spec": self.spec, "tokenizer": self._tokenizer_json,
                          "tokenizer_dir": str(source_dir(self.tokenizer) or ""),
                          "difficulty": self.difficulty, "options": self.options,
                          "chat_template_kwargs": self.chat_template_kwargs})
        with self._lock:
            self._all.add(worker)
        return worker

    def give_back(self, worker: _Worker) -> None:
        with self._lock:
            if not self.closed and worker.alive:
                self._idle.append(worker)
                return
            self._all.discard(worker)
        worker.kill()

    def log_failure(self, reason: str, message: str) -> None:
        """Log the first failure of each reason (later ones are counted, not logged)."""
        with self._lock:
            first = reason not in self._logged
            self._logged.add(reason)
        if first:
            log.error("environment %s: %s; the episode ends with reward 0, counted as "
                      "env errors/%s (later ones counted, not logged)", self.name, message, reason)

    def start(self, task: Task) -> Episode:
        """Begin ``task``'s episode in an idle worker (a new one if none); ``EnvCallFailed``
        when the environment fails to start it."""
        with self._lock:
            if self.closed:
                raise RuntimeError(f"environment {self.name} is closed")
            worker = self._idle.pop() if self._idle else None
        try:
            worker = worker or self._new_worker()
            a = worker.call({"op": "start", "task": {"task_id": task.task_id, "env": task.env,
                                                     "payload": task.payload}}, self.timeout_s)
        except EnvCallFailed as e:
            if worker is not None:
                self.give_back(worker)
            self.log_failure(e.reason, f"start: {e}")
            raise
        prompt, stop = _ids(a.get("prompt"), self.vocab_size), _ids(a.get("stop"), self.vocab_size)
        if not prompt or stop is None:
            self.give_back(worker)
            message = f"start returned prompt {str(a.get('prompt'))[:60]}, stop {str(a.get('stop'))[:60]}"
            self.log_failure("bad_output", message)
            raise EnvCallFailed("bad_output", message)
        episode = IsolatedEpisode(self, worker, prompt, stop, _counts(a.get("errors")))
        episode.wants_logprobs = a.get("wants_logprobs") is True
        return episode

    def _in_process(self) -> Environment:
        if self._local is None:
            self._local = make_env(self.spec, self.tokenizer, difficulty=self.difficulty, **self.options)
        return self._local

    def sample_task(self, rng, task_id: str) -> Task:
        return self._in_process().sample_task(rng, task_id)

    def sample_task_at(self, rng, task_id: str, draw: int) -> Task:
        return self._in_process().sample_task_at(rng, task_id, draw)

    def demonstration(self, task: Task) -> tuple[list[int], list[int]]:
        return self._in_process().demonstration(task)

    def close(self) -> None:
        """Stop every worker (and what its episodes started); idempotent."""
        with self._lock:
            self.closed = True
            workers, self._idle = list(self._all), []
            self._all.clear()
        for worker in workers:
            if worker.alive:
                try:
                    worker.proc.stdin.close()  # the worker exits at the end of its input
                    worker.proc.wait(timeout=2)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            worker.kill()
        if self._local is not None:
            self._local.close()


def build_env(spec: str, tokenizer: Tokenizer, *, difficulty: int = 1,
              options: dict[str, Any] | None = None) -> Environment:
    """The environment of a mix entry as a sampler runs it: a built-in one as is, an outside one
    (import path, entry point) in worker processes (``IsolatedEnvironment``)."""
    if spec in ENVIRONMENTS:
        return make_env(spec, tokenizer, difficulty=difficulty, **(options or {}))
    return IsolatedEnvironment(spec, tokenizer, difficulty, options)


__all__ = ["EnvCallFailed", "IsolatedEnvironment", "IsolatedEpisode", "build_env", "failed_episode"]
