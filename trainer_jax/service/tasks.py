"""Where the rollout service's tasks come from: a small interface plus the built-in arithmetic source.

A ``TaskSource`` hands out ``TaskSpec`` s (prompt token ids, environment name and payload, sampling
parameters, group size) and may score finished samples on the trainer side. The environments
issue plugs its sources in with ``register_task_source``; the service only ever sees this
interface.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from mixrl_wire import pb

if TYPE_CHECKING:
    from trainer_jax.config import TasksConfig
    from trainer_jax.service.validation import TrajectoryRecord


@dataclasses.dataclass(frozen=True)
class SamplingSpec:
    """Sampling parameters of a task; sample ``i`` of the task uses ``seed + i``."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    head_k: int = 20
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0

    def truncates(self, vocab_size: int) -> bool:
        """Whether samples carry support sets: greedy, nucleus or top-k truncation active.

        The same rule as the sampler engine's ``SamplingParams.truncates``.
        """
        return self.temperature == 0 or self.top_p < 1.0 or 0 < self.top_k < vocab_size

    def to_pb(self) -> pb.SamplingParams:
        return pb.SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                 head_k=self.head_k, max_new_tokens=self.max_new_tokens,
                                 stop_token_ids=list(self.stop_token_ids), seed=self.seed)


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """One prompt to be sampled ``group_size`` times.

    ``payload`` goes to the sampler with the task (its environment reads it); ``private`` stays on
    the trainer (e.g. the answer a trainer-side scorer checks against).
    """

    prompt_ids: tuple[int, ...]
    env: str
    sampling: SamplingSpec
    group_size: int
    payload: bytes = b""
    # Upper bound on policy tokens per sample (None: only the service's global token limit);
    # single-turn sources set it to max_new_tokens, multi-turn environments leave it open.
    max_policy_tokens: int | None = None
    private: Any = None


class TaskSource(Protocol):
    """A stream of tasks, plus an optional trainer-side scorer."""

    def next_task(self) -> TaskSpec | None:
        """The next task, or ``None`` when the source is exhausted."""
        ...

    def score(self, task: TaskSpec, record: TrajectoryRecord) -> float | None:
        """Reward of a validated sample, or ``None`` to keep the reward the sampler reported."""
        ...


TaskSourceFactory = Callable[["TasksConfig"], TaskSource]
TASK_SOURCES: dict[str, TaskSourceFactory] = {}


def register_task_source(name: str) -> Callable[[TaskSourceFactory], TaskSourceFactory]:
    def deco(factory: TaskSourceFactory) -> TaskSourceFactory:
        if name in TASK_SOURCES:
            raise ValueError(f"task source {name!r} is already registered")
        TASK_SOURCES[name] = factory
        return factory
    return deco


def build_task_source(cfg: TasksConfig) -> TaskSource:
    try:
        factory = TASK_SOURCES[cfg.env]
    except KeyError:
        raise ValueError(f"tasks.env: unknown environment {cfg.env!r}; "
                         f"known: {sorted(TASK_SOURCES)}") from None
    return factory(cfg)


class ArithmeticTasks:
    """``a+b=`` style prompts over the character tokenizer, scored by exact answer on the trainer.

    Deterministic in ``seed``: task ``n`` is the same whatever the lease order.
    """

    def __init__(self, *, seed: int = 0, group_size: int = 4, count: int | None = None,
                 max_operand: int = 99, operations: str = "+", sampling: SamplingSpec | None = None,
                 stop_at_eos: bool = True, tokenizer=None):
        from convert.tokenizer import char_tokenizer, special_token_ids

        self.tokenizer = tokenizer or char_tokenizer()
        specials = special_token_ids(self.tokenizer)
        self.bos, self.eos = specials["bos"], specials["eos"]
        base = sampling or SamplingSpec()
        if stop_at_eos and self.eos not in base.stop_token_ids:
            base = dataclasses.replace(base, stop_token_ids=(*base.stop_token_ids, self.eos))
        self.sampling = base
        self.group_size = group_size
        self.count = count
        self.max_operand = max_operand
        self.operations = operations
        self.seed = seed
        self._next = 0

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def next_task(self) -> TaskSpec | None:
        if self.count is not None and self._next >= self.count:
            return None
        n = self._next
        self._next += 1
        rng = np.random.default_rng([self.seed, n])
        a, b = (int(x) for x in rng.integers(0, self.max_operand + 1, size=2))
        op = self.operations[int(rng.integers(len(self.operations)))]
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        question = f"{a}{op}{b}="
        prompt = (self.bos, *self.tokenizer.encode(question).ids)
        sampling = dataclasses.replace(self.sampling, seed=int(rng.integers(2**31)))
        # The payload of sampler_torch.envs' "arithmetic" environment, so samplers can run it.
        payload = json.dumps({"a": a, "b": b, "op": op}).encode()
        return TaskSpec(prompt_ids=prompt, env="arithmetic", sampling=sampling,
                        group_size=self.group_size, payload=payload,
                        max_policy_tokens=sampling.max_new_tokens, private=str(answer))

    def score(self, task: TaskSpec, record: TrajectoryRecord) -> float:
        """1 when the reply is exactly the answer followed by ``<eos>`` (the environment's rule)."""
        tokens = record.policy_token_ids()
        # Cheap rejections first: this runs on the service's hot path for every sample.
        if not len(tokens) or int(tokens[-1]) != self.eos or len(tokens) > len(task.private) + 1:
            return 0.0
        text = self.tokenizer.decode(tokens[:-1].tolist(), skip_special_tokens=False)
        return 1.0 if text == task.private else 0.0


@register_task_source("arithmetic")
def _arithmetic(cfg: TasksConfig) -> ArithmeticTasks:
    s = cfg.sampling
    sampling = SamplingSpec(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, head_k=s.head_k,
                            max_new_tokens=s.max_new_tokens)
    return ArithmeticTasks(seed=cfg.seed, group_size=cfg.group_size, count=cfg.count,
                           max_operand=cfg.arithmetic.max_operand, operations=cfg.arithmetic.operations,
                           sampling=sampling, stop_at_eos=s.stop_at_eos)
