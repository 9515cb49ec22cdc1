"""Where the rollout service's tasks come from: the environments of ``envs``, mixed by weight.

A ``TaskSource`` hands out ``TaskSpec`` s (prompt token ids, environment name and payload, sampling
parameters, group size) and scores finished samples on the trainer side. ``EnvTaskSource`` is the
one implementation: task ``n`` is a pure function of ``(seed, n)``, so a resumed run continues from
its cursor with fresh tasks and never hands out a task it already trained on. Samplers run the
episodes (the tool sandbox lives on the sampler host); single-turn answers are re-scored here from
the tokens, so a sampler's reported reward is never trusted for them.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from convert.tokenizer import char_tokenizer, source_dir
from envs import Environment, Task, make_env
from envs.base import split_finish_reason
from envs.loading import default_name
from envs.rewards import RewardPool, RewardResult
from envs.tool_calls import turn_stats
from mixrl_wire.sampling import SamplingParams

if TYPE_CHECKING:
    from trainer_jax.config import MixEntry, TasksConfig
    from trainer_jax.service.validation import TrajectoryRecord


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """One prompt to be sampled ``group_size`` times.

    ``payload`` goes to the sampler with the task (its environment reads it); ``private`` stays on
    the trainer (the task and environment a trainer-side scorer checks against). An *evaluation*
    task is leased only to ``group`` (any group when None) and only to samplers holding weights
    ``min_version`` or newer; its samples are scored like any other but never reach the training
    buffer.
    """

    prompt_ids: tuple[int, ...]
    env: str
    sampling: SamplingParams
    group_size: int
    payload: bytes = b""
    # Upper bound on policy tokens per sample (None: only the service's global token limit);
    # single-turn environments set it to max_new_tokens, multi-turn ones leave it open.
    max_policy_tokens: int | None = None
    private: Any = None
    evaluation: bool = False
    group: str | None = None
    min_version: int = 0


class TaskSource(Protocol):
    """A stream of tasks, plus a trainer-side scorer."""

    def next_task(self) -> TaskSpec | None:
        """The next task, or ``None`` when the source is exhausted."""
        ...

    def score(self, task: TaskSpec, record: TrajectoryRecord) -> float | None:
        """Reward of a validated sample, or ``None`` to keep the reward the sampler reported."""
        ...


class EnvTaskSource:
    """Tasks drawn from environments by weight; ``mix`` entries are ``MixEntry`` configs.

    ``evaluation``: environments with a held-out file (``dataset``'s ``eval_path``) draw from it.
    """

    def __init__(self, mix: list[MixEntry], *, seed: int = 0, group_size: int = 4, count: int | None = None,
                 sampling: SamplingParams | None = None, tokenizer=None, prefix: str = "t",
                 chat_template_kwargs: dict[str, Any] | None = None, evaluation: bool = False):
        if not mix:
            raise ValueError("tasks.mix: list at least one environment")
        self.tokenizer = tokenizer or char_tokenizer()
        self.envs: list[Environment] = [
            make_env(m.env, self.tokenizer, difficulty=m.difficulty, **m.options) for m in mix]
        # what tasks and metrics call each entry (MixEntry.name: default the env's name)
        self.names = [m.name or default_name(m.env) for m in mix]
        #: the mix as samplers receive it at registration (``RegisterResponse.envs``)
        self.env_specs = [dict(name=n, env=m.env, options_json=json.dumps(m.options),
                               difficulty=m.difficulty) for n, m in zip(self.names, mix, strict=True)]
        if evaluation:
            self.envs = [env.for_evaluation() if hasattr(env, "for_evaluation") else env for env in self.envs]
        for env in self.envs:
            env.chat_template_kwargs = dict(chat_template_kwargs or {})
        weights = np.asarray([m.weight for m in mix], np.float64)
        self.weights = weights / weights.sum()
        self.sampling = sampling or SamplingParams(max_new_tokens=16)
        self.seed, self.group_size, self.count, self.prefix = seed, group_size, count, prefix
        self.cursor = 0
        self.rewards = RewardLedger()
        # Per environment, how many of tasks 0..n-1 it drew (a dataset walks its rows in that
        # order): (n, counts), advanced incrementally as the cursor moves.
        self._draws = (0, [0] * len(self.envs))

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary when the tokenizer came from a model directory (Qwen3 pads its
        151,669 tokens to 151,936 rows: a sampled padding id is valid on the wire), else the tokenizer's."""
        d = source_dir(self.tokenizer)
        if d is not None and (d / "config.json").is_file():
            vocab = json.loads((d / "config.json").read_text()).get("vocab_size")
            if isinstance(vocab, int) and vocab >= self.tokenizer.get_vocab_size():
                return vocab
        return self.tokenizer.get_vocab_size()

    def _choice(self, n: int) -> tuple[np.random.Generator, int]:
        rng = np.random.default_rng([self.seed, n])
        if len(self.envs) == 1:
            return rng, 0
        return rng, int(rng.choice(len(self.envs), p=self.weights))

    def _draw(self, n: int, env_index: int) -> int:
        """How many of tasks ``0..n-1`` came from environment ``env_index``."""
        if len(self.envs) == 1:
            return n
        at, counts = self._draws
        if n < at:
            at, counts = 0, [0] * len(self.envs)
        counts = list(counts)
        for m in range(at, n):
            counts[self._choice(m)[1]] += 1
        self._draws = (n, counts)
        return counts[env_index]

    def task(self, n: int) -> tuple[Task, Environment]:
        """Task number ``n`` and the environment it belongs to (deterministic in seed and n)."""
        rng, i = self._choice(n)
        env = self.envs[i]
        return env.sample_task_at(rng, f"{self.prefix}{n}", self._draw(n, i)), env

    def spec(self, n: int, *, group_size: int | None = None, **fields) -> TaskSpec:
        """The ``TaskSpec`` of task ``n``; ``fields`` set the evaluation fields or the sampling."""
        task, env = self.task(n)
        with env.start(task) as episode:
            prompt, stops = tuple(episode.prompt), episode.stop_token_ids
        sampling = fields.pop("sampling", self.sampling)
        sampling = dataclasses.replace(
            sampling, stop_token_ids=tuple(dict.fromkeys((*sampling.stop_token_ids, *stops))),
            seed=int(np.random.default_rng([self.seed, n, 1]).integers(2**31)))
        return TaskSpec(prompt_ids=prompt, env=self.names[self.envs.index(env)], sampling=sampling,
                        group_size=group_size or self.group_size, payload=json.dumps(task.payload).encode(),
                        max_policy_tokens=sampling.max_new_tokens if env.single_turn else None,
                        private=(task, env), **fields)

    def next_task(self) -> TaskSpec | None:
        if self.count is not None and self.cursor >= self.count:
            return None
        self.cursor += 1
        return self.spec(self.cursor - 1)

    def score(self, spec: TaskSpec, record: TrajectoryRecord) -> float | None:
        task, env = spec.private
        if not env.single_turn:
            return None  # multi-turn: the sampler ran the sandbox; keep its reward
        result = env.score(task, record.policy_token_ids().tolist())
        if isinstance(result, RewardResult):
            self.rewards.put((record.task_id, record.sample_index), result)
            return result.reward
        return result

    def scores_slowly(self, spec: TaskSpec) -> bool:
        """Whether ``score`` calls a reward function in a worker process (a dataset's reward):
        the rollout service then scores the sample off its RPC threads (``service.scoring``)."""
        env = spec.private[1] if isinstance(spec.private, tuple) else None
        pool = getattr(env, "reward", None)
        return bool(env is not None and env.single_turn and isinstance(pool, RewardPool))

    def metrics(self, groups) -> dict[str, float]:
        """Diagnostics of a step's ``TrajectoryGroup`` s the service cannot see on its own:
        reward-function failures and timeouts per sampler group with the mean of each numeric key
        the reward returned beside ``reward``, and, for tool episodes in the model's own format,
        the shares of turns with a malformed call, an empty reply or no tool call (per group and
        overall, ``tool/*``)."""
        values = self.rewards.metrics([t for g in groups for t in g.trajectories])
        values.update(env_error_metrics(groups))
        values.update(env_reward_part_metrics(groups))
        for env in self.envs:  # what loading counted (a dataset's skipped rows): env/<name>/<key>
            for key, value in getattr(env, "load_metrics", dict)().items():
                values[f"env/{env.name}/{key}"] = value
        stats: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for g in groups:
            env = g.task.private[1] if isinstance(g.task.private, tuple) else None
            chat = getattr(env, "chat", None)
            if env is None or env.single_turn or chat is None:
                continue
            # An environment with tools of its own (``repo``) reads its turns itself.
            stats_of = getattr(env, "turn_stats", None) or (
                lambda ids, mask, chat=chat: turn_stats(chat, ids, mask))
            for t in g.trajectories:
                counts = stats_of(t.token_ids, t.loss_mask)
                stats[t.group].update(counts)
                stats[""].update(counts)
        for group, c in stats.items():
            turns = max(1, c["turns"])
            prefix = "tool/" if group == "" else f"group/{group}/tool_"
            values.update({f"{prefix}malformed": c["malformed_calls"] / turns,
                           f"{prefix}empty": c["empty_replies"] / turns,
                           f"{prefix}toolless": c["toolless_turns"] / turns})
            if "call_turns" in c:  # share of turns with a well-formed call (CollapseAlarms watches it)
                values[f"{prefix}call_rate"] = c["call_turns"] / turns
        return values

    def close(self) -> None:
        for env in self.envs:
            env.close()


class RewardLedger:
    """Reward results by ``(task_id, sample_index)`` until the step that trains on them reads them.

    Bounded: evaluation samples (never read by a step) and dropped groups age out.
    """

    def __init__(self, capacity: int = 200_000):
        self._results: collections.OrderedDict[tuple[int, int], RewardResult] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.capacity = capacity

    def put(self, key: tuple[int, int], result: RewardResult) -> None:
        with self._lock:
            self._results[key] = result
            while len(self._results) > self.capacity:
                self._results.popitem(last=False)

    def metrics(self, trajectories) -> dict[str, float]:
        with self._lock:
            found = [(t.group, self._results.pop((t.task_id, t.sample_index), None)) for t in trajectories]
        found = [(g, r) for g, r in found if r is not None]
        if not found:
            return {}
        values: dict[str, float] = {}
        sums: dict[str, list[float]] = collections.defaultdict(list)
        for group in sorted({g for g, _ in found}):
            mine = [r for g, r in found if g == group]
            values[f"group/{group}/reward_errors"] = float(sum(_is_error(r) for r in mine))
            values[f"group/{group}/reward_timeouts"] = float(sum(r.timed_out for r in mine))
        for _, r in found:
            for k, v in r.metrics.items():
                sums[k].append(v)
        values["reward_errors"] = float(sum(_is_error(r) for _, r in found))
        values["reward_timeouts"] = float(sum(r.timed_out for _, r in found))
        # Failures by reason (envs.rewards.RewardResult.reason: timeout, exception, memory, crashed,
        # forked, stray_output, bad_return, ...): which way the reward function fails.
        reasons = collections.Counter(r.reason or ("timeout" if r.timed_out else "error")
                                      for _, r in found if r.timed_out or r.error is not None)
        values.update({f"reward/errors/{k}": float(n) for k, n in sorted(reasons.items())})
        values.update({f"reward/{k}": float(np.mean(v)) for k, v in sums.items()})
        return values


def env_error_metrics(groups) -> dict[str, float]:
    """``env/<entry>/errors/<reason>``: how many of a step's samples each environment counted
    under each reason (a refused command, an unsafe file, an exception that ended the episode),
    read from the samples' finish_reason (``envs.base.finish_reason``)."""
    values: dict[str, float] = collections.defaultdict(float)
    for g in groups:
        for t in g.trajectories:
            for reason, n in split_finish_reason(getattr(t, "finish_reason", "") or "")[1].items():
                values[f"env/{g.task.env}/errors/{reason}"] += n
    return dict(values)


def env_reward_part_metrics(groups) -> dict[str, float]:
    """``env/<entry>/reward/<name>``: the mean of each named reward component (a verifiers
    rubric's reward functions, ``Trajectory.reward_parts``) over the step's samples that carry it."""
    sums: dict[str, list[float]] = collections.defaultdict(list)
    for g in groups:
        for t in g.trajectories:
            for name, value in (getattr(t, "reward_parts", None) or {}).items():
                sums[f"env/{g.task.env}/reward/{name}"].append(value)
    return {key: float(np.mean(v)) for key, v in sorted(sums.items())}


def _is_error(r: RewardResult) -> bool:
    return r.error is not None and not r.timed_out


def build_task_source(cfg: TasksConfig, *, tokenizer=None, seed: int | None = None,
                      prefix: str = "t", evaluation: bool = False) -> EnvTaskSource:
    """The task source ``cfg`` describes (``seed``/``prefix``/``evaluation`` for held-out evaluation)."""
    return EnvTaskSource(cfg.mix_entries(), seed=cfg.seed if seed is None else seed,
                         group_size=cfg.group_size, count=cfg.count, sampling=cfg.sampling,
                         tokenizer=tokenizer, prefix=prefix, chat_template_kwargs=cfg.chat_template_kwargs,
                         evaluation=evaluation)
