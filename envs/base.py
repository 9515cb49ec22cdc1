"""The environment interface: token in, token out, so history is never re-tokenized.

An ``Environment`` makes tasks and starts episodes. An ``Episode`` gives the prompt tokens, then
takes each policy turn's generated tokens and answers with observation tokens (which the trainer
masks out of the loss), a reward and whether the episode is over, with a termination reason.
Environments are registered by name so a config can list them.
"""

from __future__ import annotations

import abc
import dataclasses
import re
from typing import Any, ClassVar

import numpy as np
from tokenizers import Tokenizer

from convert.tokenizer import special_token_ids

# Why an episode ended; the diagnostics report the share of each. ``error``: the environment
# raised (an exception is an episode's end with reward 0, never a dead sampler).
TERMINATIONS = ("answered", "submitted", "turn_limit", "toolless_stop", "empty_reply", "length", "error")
# The wire's finish_reason carries the termination and the episode's counted errors (the trainer
# validates it as printable and at most this long): "turn_limit" or "turn_limit;nul_command=2,exception".
FINISH_REASON_CHARS = 64
_REASON = re.compile(r"[a-z][a-z0-9_]{0,39}")


def finish_reason(termination: str, errors: dict[str, int] | None = None) -> str:
    """``termination`` with the episode's error counts appended, within ``FINISH_REASON_CHARS``
    (the most frequent reasons first; those that do not fit are dropped, never the termination)."""
    text = termination
    for i, (reason, n) in enumerate(sorted((errors or {}).items(), key=lambda kv: (-kv[1], kv[0]))):
        item = ("," if i else ";") + (reason if n == 1 else f"{reason}={n}")
        if len(text) + len(item) > FINISH_REASON_CHARS:
            break
        text += item
    return text


def split_finish_reason(text: str) -> tuple[str, dict[str, int]]:
    """``(termination, {reason: count})`` of a finish_reason written by ``finish_reason``;
    anything malformed in the error part is ignored (it came over the wire)."""
    termination, _, rest = text.partition(";")
    errors: dict[str, int] = {}
    for item in filter(None, rest.split(",")):
        reason, _, n = item.partition("=")
        # A metric name and a count, or nothing ("²" is a digit to isdigit, not to int).
        if _REASON.fullmatch(reason) and (not n or (n.isascii() and n.isdigit() and len(n) <= 6)):
            errors[reason] = errors.get(reason, 0) + (int(n) if n else 1)
    return termination, errors


@dataclasses.dataclass(frozen=True)
class Task:
    """What the router hands a sampler: an id, the environment's name and a JSON payload."""

    task_id: str
    env: str
    payload: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class StepResult:
    observation: list[int]
    reward: float
    done: bool
    termination: str | None = None

    def __post_init__(self):
        if self.done and self.termination not in TERMINATIONS:
            raise ValueError(f"termination {self.termination!r} not in {TERMINATIONS}")


class Episode(abc.ABC):
    prompt: list[int]
    stop_token_ids: tuple[int, ...]

    @abc.abstractmethod
    def step(self, generated: list[int]) -> StepResult:
        """Consume one policy turn (ending at a stop token or the length limit)."""

    def close(self) -> None:  # noqa: B027  (optional hook: most episodes hold nothing)
        """Release resources (sandbox directories); idempotent."""

    def note_error(self, reason: str) -> None:
        """Count a problem the model's output caused (a refused command, an unsafe file): the
        episode goes on or ends normally; the trainer reports ``env/<entry>/errors/<reason>``."""
        errors = self.__dict__.setdefault("_errors", {})
        errors[reason] = errors.get(reason, 0) + 1

    @property
    def errors(self) -> dict[str, int]:
        """The counts ``note_error`` kept, by reason."""
        return dict(self.__dict__.get("_errors", {}))

    @property
    def reward_parts(self) -> dict[str, float]:
        """The reward's named components once the episode ended (a rubric's reward functions),
        sent as ``Trajectory.reward_parts`` and logged as ``env/<entry>/reward/<name>``; most
        episodes have none."""
        return {}

    def __enter__(self) -> Episode:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Environment(abc.ABC):
    name: ClassVar[str]
    #: True when an episode is one policy turn whose reward follows from the generated tokens
    #: alone: the trainer then re-scores every sample itself and never trusts the sampler's
    #: reward. Multi-turn environments (tools, sandboxes) run where the sampler runs; their
    #: reward is the one the sampler reports.
    single_turn: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not getattr(cls, "name", None):  # an outside environment may leave it out
            cls.name = cls.__name__

    def __init__(self, tokenizer: Tokenizer, difficulty: int = 1):
        if difficulty < 1:
            raise ValueError(f"{self.name}: difficulty must be >= 1, got {difficulty}")
        self.tokenizer = tokenizer
        self.difficulty = difficulty
        specials = special_token_ids(tokenizer)
        # None for a real model's tokenizer: environments that need them say so when built.
        self.bos, self.eos = specials.get("bos"), specials.get("eos")
        # Template arguments (``tasks.chat_template_kwargs``); the task source sets them.
        self.chat_template_kwargs: dict[str, Any] = {}

    def score(self, task: Task, generated: list[int]) -> float:
        """Trainer-side reward of a single-turn reply (``single_turn`` environments)."""
        with self.start(task) as episode:
            return episode.step(generated).reward

    def close(self) -> None:  # noqa: B027  (optional hook: most environments hold nothing)
        """Release what the environment holds (reward worker processes); idempotent."""

    def sample_task_at(self, rng: np.random.Generator, task_id: str, draw: int) -> Task:
        """Task ``task_id``, this environment's ``draw``-th: environments that walk a fixed list
        (datasets) use ``draw``; generators use ``rng``."""
        return self.sample_task(rng, task_id)

    @abc.abstractmethod
    def sample_task(self, rng: np.random.Generator, task_id: str) -> Task:
        """A fresh task; the payload holds everything needed to score it."""

    @abc.abstractmethod
    def start(self, task: Task) -> Episode:
        """Begin an episode of ``task``."""

    def demonstration(self, task: Task) -> tuple[list[int], list[int]]:
        """A correct episode as ``(token_ids, loss_mask)`` for the supervised warm start.

        Optional: an environment without demonstrations cannot be in the mix of a run with
        ``sft.steps > 0`` (refused when the config loads, ``envs.loading.has_demonstration``)."""
        raise NotImplementedError(f"environment {self.name!r} has no demonstrations")

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


ENVIRONMENTS: dict[str, type[Environment]] = {}


def register_env(cls: type[Environment]) -> type[Environment]:
    if cls.name in ENVIRONMENTS:
        raise ValueError(f"environment {cls.name!r} registered twice")
    ENVIRONMENTS[cls.name] = cls
    return cls

