"""Long single-turn tasks, where a per-token mismatch has many tokens to compound over.

``chain``: a running total written out step by step. The prompt is ``chain 7+3-5+8...=`` with
``8 + difficulty`` single-digit terms; the answer writes every intermediate result,
``7+3=10,10-5=5,5+8=13,...``, then ``<eos>``. With at least 8 steps of at least 6 characters
(``a+b=c,``) a correct reply is >= 47 policy tokens with the character tokenizer (about 55 on
average at difficulty 1), and every token after the first step depends on the tokens before it.

Scoring is exact and trainer-side (``single_turn``): ``scoring: exact`` (default) gives 1 when the
whole text before ``<eos>`` equals the answer; ``scoring: steps`` gives the share of steps, in
order, written exactly as in the answer; ``scoring: prefix`` gives the length of the reply's
longest correct prefix over the answer's (1 only for the exact answer ended by ``<eos>``): the
densest signal, and one where an early wrong token costs everything after it. The dense ones are
for small models whose warm start rarely gets a whole chain right (150 SFT steps of the tiny local
model: no step right, so ``steps`` scores 0 everywhere).
The demonstration is the answer itself, for the supervised warm start.
"""

from __future__ import annotations

import numpy as np

from envs.base import Episode, Task, register_env
from envs.single_turn import AnswerEpisode, SingleTurnEnv

SCORINGS = ("exact", "steps", "prefix")


def chain(terms: list[int], ops: list[str]) -> str:
    """The written-out running total of ``terms[0] ops[0] terms[1] ...``."""
    total, steps = terms[0], []
    for op, b in zip(ops, terms[1:], strict=True):
        new = total + b if op == "+" else total - b
        steps.append(f"{total}{op}{b}={new}")
        total = new
    return ",".join(steps)


class _PartialEpisode(AnswerEpisode):
    """Partial credit (``steps`` or ``prefix``, see the module docstring); no ``<eos>`` scores 0."""

    def __init__(self, env: SingleTurnEnv, prompt_text: str, answer: str, scoring: str):
        super().__init__(env, prompt_text, answer)
        self.scoring = scoring

    def reward(self, text: str) -> float:
        if self.scoring == "prefix":
            n = next((i for i, (a, b) in enumerate(zip(text, self.answer, strict=False)) if a != b),
                     min(len(text), len(self.answer)))
            return n / max(len(self.answer), len(text))
        want, got = self.answer.split(","), text.split(",")
        return sum(a == b for a, b in zip(want, got, strict=False)) / max(len(want), len(got))


@register_env
class Chain(SingleTurnEnv):
    """Running totals of ``8 + difficulty`` single-digit terms, each step written out."""

    name = "chain"

    def __init__(self, tokenizer, difficulty: int = 1, scoring: str = "exact"):
        super().__init__(tokenizer, difficulty)
        if scoring not in SCORINGS:
            raise ValueError(f"chain: scoring {scoring!r}, expected one of {', '.join(SCORINGS)}")
        self.scoring = scoring

    def sample_task(self, rng: np.random.Generator, task_id: str) -> Task:
        n = 8 + self.difficulty
        terms = [int(x) for x in rng.integers(0, 10, n)]
        ops = [str(o) for o in rng.choice(["+", "-"], n - 1)]
        return Task(task_id, self.name, {"terms": terms, "ops": ops})

    def _problem(self, payload: dict) -> tuple[str, str]:
        terms, ops = [int(t) for t in payload["terms"]], [str(o) for o in payload["ops"]]
        if len(ops) != len(terms) - 1 or set(ops) - {"+", "-"}:
            raise ValueError(f"chain: malformed payload {payload}")
        expr = str(terms[0]) + "".join(f"{o}{t}" for o, t in zip(ops, terms[1:], strict=True))
        return f"chain {expr}=", chain(terms, ops)

    def start(self, task: Task) -> Episode:
        if self.scoring == "exact":
            return super().start(task)
        prompt, answer = self._problem(task.payload)
        return _PartialEpisode(self, prompt, answer, self.scoring)


__all__ = ["SCORINGS", "Chain", "chain"]
