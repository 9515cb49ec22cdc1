"""``chat_math``: multi-digit arithmetic word problems for a model's own tokenizer, no data file.

The character-level ``arithmetic`` task needs the ``<bos>``/``<eos>`` of the character tokenizer;
a real checkpoint speaks through its chat template instead. Each task here is a one-line word
problem (``"A crate holds 487 bottles. How many bottles are in 63 crates?"``) rendered as a user
turn after a system prompt asking for the answer in ``\\boxed{}``, through the model's template
(``tasks.chat_template_kwargs`` apply, e.g. Qwen3's ``enable_thinking``). The reply is graded on
the trainer by the built-in ``math`` reward (``envs.rewards.builtin``: the last ``\\boxed{}``
against the answer, as numbers) in a worker pool with a timeout, as dataset rewards are, so a
pathological reply cannot stall the trainer.

``difficulty`` is the number of digits of each operand (products then reach twice that). Options:
``system_prompt``, ``reward_timeout_s``, ``reward_workers``. Without a chat template (the
character tokenizer) the prompt is the turns' text after ``<bos>`` and the reply ends at
``<eos>``, as with ``env: dataset``.

The payload carries the question, the answer, the system prompt and the template arguments, so a
sampler that builds this environment by name renders exactly the trainer's prompt.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from envs.base import Environment, Episode, Task, register_env
from envs.chat import Chat
from envs.dataset import ReplyEpisode, prompt_messages, render_prompt
from envs.rewards import RewardPool, RewardResult

SYSTEM_PROMPT = "Solve the problem. Give the final answer as \\boxed{n}."
NAMES = ("Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro")
# Per operation, problems whose answer is a op b (for "-", a >= b).
PROBLEMS: dict[str, tuple[str, ...]] = {
    "+": ("{name} has {a} marbles and wins {b} more. How many marbles does {name} have now?",
          "A farm picked {a} apples on Monday and {b} on Tuesday. How many apples did it pick in all?"),
    "-": ("A library owns {a} books and lends out {b} of them. How many books are still on its shelves?",
          "{name} saved {a} dollars and spent {b} dollars on a bike. How many dollars are left?"),
    "*": ("A crate holds {a} bottles. How many bottles are in {b} crates?",
          "{name} reads {a} pages a day for {b} days. How many pages does {name} read?"),
}


@register_env
class ChatMath(Environment):
    """Arithmetic word problems in the model's chat format, scored by the ``math`` reward."""

    name = "chat_math"
    single_turn = True

    def __init__(self, tokenizer, difficulty: int = 2, *, system_prompt: str = SYSTEM_PROMPT,
                 reward_timeout_s: float = 10.0, reward_workers: int = 2):
        super().__init__(tokenizer, difficulty)
        self.system_prompt = system_prompt
        self.chat = Chat.from_tokenizer(tokenizer)
        if self.chat is None and self.eos is None:
            raise ValueError("chat_math: the tokenizer has neither a chat template nor an <eos> token")
        # Workers start on the first score: a sampler building the environment starts none.
        self.reward = RewardPool("math", workers=reward_workers, timeout_s=reward_timeout_s)

    def _question(self, a: int, b: int, op: str, template: int, name: int) -> str:
        if op == "-" and a < b:
            a, b = b, a
        return PROBLEMS[op][template].format(a=a, b=b, name=NAMES[name])

    def sample_task(self, rng: np.random.Generator, task_id: str) -> Task:
        low = 10 ** (self.difficulty - 1) if self.difficulty > 1 else 0
        a, b = (int(x) for x in rng.integers(low, 10 ** self.difficulty, 2))
        op = str(rng.choice(list(PROBLEMS)))
        if op == "-" and a < b:
            a, b = b, a
        template, name = int(rng.integers(len(PROBLEMS[op]))), int(rng.integers(len(NAMES)))
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        payload = self._payload(self._question(a, b, op, template, name), answer)
        return Task(task_id, self.name, {**payload, "a": a, "b": b, "op": op})

    def _payload(self, question: str, answer: int) -> dict[str, Any]:
        return {"question": question, "answer": str(answer), "system_prompt": self.system_prompt,
                "chat_template_kwargs": dict(self.chat_template_kwargs)}

    def _prompt(self, payload: dict) -> list[int]:
        messages = prompt_messages(str(payload["question"]), payload.get("system_prompt"), where=self.name)
        text = render_prompt(self.chat, messages, payload.get("chat_template_kwargs"))
        return self.chat.encode(text) if self.chat is not None else [self.bos] + self.encode(text)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self.chat.stop_ids if self.chat is not None else (self.eos,)

    def start(self, task: Task) -> Episode:
        return ReplyEpisode(self._prompt(task.payload), self.stop_ids)

    def score(self, task: Task, generated: list[int]) -> RewardResult:
        body = generated[:-1] if generated and generated[-1] in self.stop_ids else generated
        return self.reward.score(completion=self.tokenizer.decode(body, skip_special_tokens=False),
                                 answer=task.payload["answer"], prompt=task.payload["question"],
                                 task=task.payload)

    def demonstration(self, task: Task) -> tuple[list[int], list[int]]:
        prompt = self._prompt(task.payload)
        reply = self.tokenizer.encode(f"The answer is \\boxed{{{task.payload['answer']}}}.",
                                      add_special_tokens=False).ids + [self.stop_ids[0]]
        return prompt + reply, [0] * len(prompt) + [1] * len(reply)

    def longest_prompt(self) -> int:
        """The most prompt tokens a task can take (``trainer_jax.batch_shape``): every problem and
        name rendered with operands of ``difficulty`` nines, plus one token per operand digit, a
        margin for tokenizers that merge some digit strings into fewer tokens than others."""
        top = 10 ** self.difficulty - 1
        longest = max(len(self._prompt(self._payload(self._question(top, top, op, t, n), 0)))
                      for op, problems in PROBLEMS.items() for t in range(len(problems))
                      for n in range(len(NAMES)))
        return longest + 2 * self.difficulty

    def close(self) -> None:
        self.reward.close()


__all__ = ["NAMES", "PROBLEMS", "SYSTEM_PROMPT", "ChatMath"]
