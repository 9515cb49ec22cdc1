"""The process an outside environment's episodes run in: ``python -m envs.isolated_worker``.

``envs.isolated`` starts one per concurrently running episode and writes one JSON request per
line on its stdin; it answers exactly one line per request on its stdout:

- ``{"op": "init", "spec", "tokenizer" (tokenizer.json text), "tokenizer_dir" (its model
  directory, or ""), "difficulty", "options", "chat_template_kwargs"}``: import the class and
  build the environment, once;
- ``{"op": "start", "task": {"task_id", "env", "payload"}}``: ``{"prompt", "stop", "errors",
  "wants_logprobs"}``;
- ``{"op": "step", "generated": [ids], "logprobs"?: [floats]}``: ``{"observation", "reward",
  "done", "termination", "errors"}``, as the episode returned them (the parent validates every
  field); ``logprobs`` (the turn's behaviour log-probs) when the episode ``wants_logprobs``;
- ``{"op": "close"}``: the episode's ``close()``.

Each answer is ``{"ok": true, ...}`` or ``{"ok": false, "reason": "exception" | "bad_output",
"error": "..."}``. Why a process: the environment is user code that may raise, hang or print;
here an exception is an answer, a hang is the parent's timeout (it kills this process group and
starts another), and the user's prints go to stderr, never onto the channel. This process dies
with its parent (``PR_SET_PDEATHSIG``) and when its stdin closes.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from typing import Any

PR_SET_PDEATHSIG = 1
#: Set in a worker's environment: what runs here is an outside environment's episode.
WORKER_ENV = "MIXRL_ENV_WORKER"
MAX_ERROR_CHARS = 500


def _plain(value: Any) -> Any:
    """JSON for numpy values; anything else is tagged so the parent counts it as a bad output."""
    import numpy as np

    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return {"unjsonable": type(value).__name__}


class _Channel:
    """Requests on the original stdin, answers on the original stdout; fds 0/1 of this process
    become /dev/null and stderr, so the environment's prints and reads never touch the channel."""

    def __init__(self):
        self.inp = os.fdopen(os.dup(0), "rb")
        self.out = os.fdopen(os.dup(1), "wb")
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.dup2(2, 1)
        sys.stdout = sys.stderr

    def requests(self):
        for line in self.inp:
            yield json.loads(line)

    def answer(self, answer: dict) -> None:
        try:
            data = json.dumps(answer, default=_plain)
        except (TypeError, ValueError) as e:  # a circular structure, a key that is no string
            data = json.dumps({"ok": False, "reason": "bad_output", "error": f"unserializable: {e}"})
        self.out.write(data.encode() + b"\n")
        self.out.flush()


class _Server:
    def __init__(self):
        self.env = None
        self.episode = None

    def handle(self, request: dict) -> dict:
        op = request["op"]
        if op == "init":
            from tokenizers import Tokenizer

            from envs.loading import resolve_env

            cls = resolve_env(request["spec"])
            options = {k: v for k, v in request["options"].items() if k != "timeout_s"}
            tokenizer = Tokenizer.from_str(request["tokenizer"])
            if request.get("tokenizer_dir"):  # where chat templates and renderers find their files
                from convert.tokenizer import SOURCE_DIR_ATTR

                setattr(tokenizer, SOURCE_DIR_ATTR, request["tokenizer_dir"])
            self.env = cls(tokenizer, difficulty=request["difficulty"], **options)
            self.env.chat_template_kwargs = request.get("chat_template_kwargs") or {}
            return {}
        if op == "start":
            from envs.base import Task

            self._close()
            t = request["task"]
            self.episode = self.env.start(Task(t["task_id"], t["env"], t["payload"]))
            return {"prompt": list(self.episode.prompt), "stop": list(self.episode.stop_token_ids),
                    "errors": self._errors(),
                    "wants_logprobs": getattr(self.episode, "wants_logprobs", False) is True}
        if op == "step":
            from envs.base import StepResult

            if "logprobs" in request:  # the turn's behaviour log-probs (Episode.wants_logprobs)
                self.episode.turn_logprobs = request["logprobs"]
            result = self.episode.step(request["generated"])
            if not isinstance(result, StepResult):
                return {"ok": False, "reason": "bad_output",
                        "error": f"step returned {type(result).__name__}, not a StepResult"}
            observation = result.observation
            if not isinstance(observation, list | tuple):
                observation = _plain(observation)
            return {"observation": observation, "reward": result.reward, "done": result.done,
                    "termination": result.termination, "errors": self._errors(),
                    "reward_parts": self._reward_parts() if result.done else {}}
        if op == "close":
            self._close()
            return {}
        raise ValueError(f"unknown op {op!r}")

    def _errors(self) -> dict:
        return self.episode.errors if hasattr(self.episode, "errors") else {}

    def _reward_parts(self) -> dict:
        parts = getattr(self.episode, "reward_parts", None)  # JSON-encoded with _plain (numpy)
        return dict(parts) if isinstance(parts, dict) else {}

    def _close(self) -> None:
        episode, self.episode = self.episode, None
        if episode is not None:
            episode.close()


def main() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the parent's process-group kill still applies
        pass
    os.environ[WORKER_ENV] = "1"  # environments that delegate to workers run here (verifiers_env)
    channel, server = _Channel(), _Server()
    for request in channel.requests():
        try:
            answer = {"ok": True, **server.handle(request)}
        except BaseException as e:  # noqa: BLE001 - SystemExit from user code is its failure too
            if isinstance(e, KeyboardInterrupt):
                raise
            answer = {"ok": False, "reason": "exception",
                      "error": f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS]}
        channel.answer(answer)


if __name__ == "__main__":
    main()
