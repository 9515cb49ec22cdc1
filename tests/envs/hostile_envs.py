"""Outside environments that misbehave, for tests/envs/test_env_isolated.py (imported by path,
``hostile_envs:Hostile``, as a user's package would be).

``mode`` (an option, or the task payload's) picks what the episode does: ``ok`` (one turn,
reward 1, one ``note_error`` of its own), ``raise`` / ``hang`` / ``exit`` in ``step``,
``start_raise`` / ``start_hang`` / ``start_garbage`` in ``start``, and garbage outputs:
``nan`` (reward), ``bad_obs`` (an id past the vocabulary), ``text_obs`` (a string observation),
``done_str`` (``done="yes"``), ``not_result`` (a dict instead of a ``StepResult``).
"""

import os
import time

from envs.base import Environment, Episode, StepResult, Task


class HostileEpisode(Episode):
    def __init__(self, env, mode: str):
        self.env, self.mode = env, mode
        if mode == "start_raise":
            raise RuntimeError("cannot start this one")
        if mode == "start_hang":
            time.sleep(600)
        self.prompt = env.encode("go:") if mode != "start_garbage" else ["g", "o"]
        self.stop_token_ids = (env.encode("\n")[-1],)

    def step(self, generated):
        mode = self.mode
        if mode == "raise":
            raise ValueError("the environment has a bug")
        if mode == "hang":
            time.sleep(600)
        if mode == "exit":
            os._exit(3)
        if mode == "nan":
            return StepResult([], float("nan"), True, "answered")
        if mode == "bad_obs":
            return StepResult([10**9], 0.0, False)
        if mode == "text_obs":
            return StepResult("higher", 0.0, False)
        if mode == "done_str":
            return StepResult([], 1.0, "yes", "answered")
        if mode == "not_result":
            return {"reward": 1.0}
        self.note_error("own_reason")
        return StepResult([], 1.0, True, "answered")


class Hostile(Environment):
    def __init__(self, tokenizer, difficulty: int = 1, *, mode: str = "ok"):
        super().__init__(tokenizer, difficulty)
        self.mode = mode

    def sample_task(self, rng, task_id: str) -> Task:
        return Task(task_id, self.name, {"mode": self.mode})

    def start(self, task: Task) -> Episode:
        return HostileEpisode(self, task.payload.get("mode", self.mode))
