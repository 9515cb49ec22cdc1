"""Single-turn verifiable tasks with exact-answer rewards.

The policy answers after the prompt and ends with ``<eos>``; the reward is 1 when the text before
``<eos>`` equals the answer exactly, else 0. ``difficulty`` scales the problem size.
"""

from __future__ import annotations

import numpy as np

from envs.base import Environment, Episode, StepResult, Task, register_env


class AnswerEpisode(Episode):
    """One reply ended by ``<eos>``; ``reward(text)`` scores the text before it (exact match
    here; subclasses give partial credit). A reply without ``<eos>`` scores 0."""

    def __init__(self, env: Environment, prompt_text: str, answer: str):
        self.env, self.answer = env, answer
        self.prompt = [env.bos] + env.encode(prompt_text)
        self.stop_token_ids = (env.eos,)

    def reward(self, text: str) -> float:
        return float(text == self.answer)

    def step(self, generated: list[int]) -> StepResult:
        ended = bool(generated) and generated[-1] == self.env.eos
        body = generated[:-1] if ended else generated
        if not body:
            return StepResult([], 0.0, True, "empty_reply")
        if not ended:
            return StepResult([], 0.0, True, "length")
        return StepResult([], self.reward(self.env.decode(body)), True, "answered")


class SingleTurnEnv(Environment):
    """One answer, scored by exact match: the trainer re-scores it from the tokens."""

    single_turn = True

    def __init__(self, tokenizer, difficulty: int = 1):
        super().__init__(tokenizer, difficulty)
        if self.bos is None or self.eos is None:
            raise ValueError(f"{self.name}: needs a tokenizer with <bos> and <eos> (the character "
                             "tokenizer); with a model's own tokenizer use env: chat_math (arithmetic "
                             "word problems through its chat template) or env: dataset")

    def _problem(self, payload: dict) -> tuple[str, str]:
        raise NotImplementedError

    def start(self, task: Task) -> Episode:
        prompt, answer = self._problem(task.payload)
        return AnswerEpisode(self, prompt, answer)

    def longest_prompt(self) -> int:
        """The most prompt tokens a task can have (``trainer_jax.batch_shape`` budgets rows by it):
        the longest prompt of ``_extreme_payloads()``."""
        return max(len(self.start(Task("longest", self.name, p)).prompt) for p in self._extreme_payloads())

    def _extreme_payloads(self) -> list[dict]:
        """Payloads with the longest prompts. Default: 16 drawn tasks, right for environments
        whose prompt length does not depend on the draw (``reverse``, ``chain``); others override."""
        rng = np.random.default_rng(0)
        return [self.sample_task(rng, "longest").payload for _ in range(16)]

    def demonstration(self, task: Task) -> tuple[list[int], list[int]]:
        prompt, answer = self._problem(task.payload)
        prompt_ids = [self.bos] + self.encode(prompt)
        answer_ids = self.encode(answer) + [self.eos]
        return prompt_ids + answer_ids, [0] * len(prompt_ids) + [1] * len(answer_ids)


@register_env
class Arithmetic(SingleTurnEnv):
    """``a+b=`` / ``a-b=`` / ``a*b=`` with ``difficulty``-digit operands (``*`` from difficulty 2)."""

    name = "arithmetic"

    def sample_task(self, rng: np.random.Generator, task_id: str) -> Task:
        hi = 10 ** self.difficulty
        ops = "+-*" if self.difficulty >= 2 else "+-"
        a, b = (int(x) for x in rng.integers(0, hi, 2))
        return Task(task_id, self.name, {"a": a, "b": b, "op": str(rng.choice(list(ops)))})

    def _extreme_payloads(self) -> list[dict]:
        top = 10 ** self.difficulty - 1  # operands of every digit
        return [{"a": top, "b": top, "op": op} for op in "+-*"]

    def _problem(self, payload: dict) -> tuple[str, str]:
        a, b, op = int(payload["a"]), int(payload["b"]), payload["op"]
        result = {"+": a + b, "-": a - b, "*": a * b}[op]
        return f"{a}{op}{b}=", str(result)


@register_env
class Reverse(SingleTurnEnv):
    """``rev abc=`` -> ``cba`` for a random lowercase word of ``2 + difficulty`` letters."""

    name = "reverse"

    def sample_task(self, rng: np.random.Generator, task_id: str) -> Task:
        n = 2 + self.difficulty
        word = "".join(chr(ord("a") + int(i)) for i in rng.integers(0, 26, n))
        return Task(task_id, self.name, {"word": word})

    def _problem(self, payload: dict) -> tuple[str, str]:
        word = str(payload["word"])
        return f"rev {word}=", word[::-1]
