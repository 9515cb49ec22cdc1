"""Tasks from the environments of ``sampler_torch.envs``, mixed by weight (``tasks.env: mix``).

Task ``n`` is a pure function of ``(seed, n)``, so a resumed run continues from its cursor with
fresh tasks and never hands out a task it already trained on. Samplers run the episodes (the tool
sandbox lives on the sampler host); single-turn answers are re-scored here from the tokens, so a
sampler's reported reward is never trusted for them.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from convert.tokenizer import char_tokenizer, special_token_ids
from sampler_torch.envs import make_env
from sampler_torch.envs.base import Task
from sampler_torch.envs.single_turn import _SingleTurnEnv
from trainer_jax.service.tasks import SamplingSpec, TaskSpec, register_task_source


class EnvTaskSource:
    def __init__(self, mix: list[dict], *, seed: int = 0, group_size: int = 4, count: int | None = None,
                 sampling: SamplingSpec | None = None, tokenizer=None, prefix: str = "t"):
        if not mix:
            raise ValueError("tasks.mix: list at least one environment")
        self.tokenizer = tokenizer or char_tokenizer()
        self.envs, weights = [], []
        for spec in mix:
            spec = dict(spec)
            name, weight = spec.pop("env"), float(spec.pop("weight", 1.0))
            if weight <= 0:
                raise ValueError(f"tasks.mix: weight of {name!r} must be > 0")
            self.envs.append(make_env(name, self.tokenizer, **spec))
            weights.append(weight)
        self.weights = np.asarray(weights) / sum(weights)
        self.sampling = sampling or SamplingSpec()
        self.eos = special_token_ids(self.tokenizer)["eos"]
        self.seed, self.group_size, self.count, self.prefix = seed, group_size, count, prefix
        self.cursor = 0

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def task(self, n: int) -> tuple[Task, object]:
        """Task number ``n`` and the environment it belongs to (deterministic in seed and n)."""
        rng = np.random.default_rng([self.seed, n])
        env = self.envs[int(rng.choice(len(self.envs), p=self.weights))]
        return env.sample_task(rng, f"{self.prefix}{n}"), env

    def next_task(self) -> TaskSpec | None:
        if self.count is not None and self.cursor >= self.count:
            return None
        n = self.cursor
        self.cursor += 1
        task, env = self.task(n)
        with env.start(task) as episode:
            prompt, stops = tuple(episode.prompt), episode.stop_token_ids
        sampling = dataclasses.replace(self.sampling, stop_token_ids=tuple(stops),
                                       seed=int(np.random.default_rng([self.seed, n, 1]).integers(2**31)))
        single = isinstance(env, _SingleTurnEnv)
        return TaskSpec(prompt_ids=prompt, env=task.env, sampling=sampling, group_size=self.group_size,
                        payload=json.dumps(task.payload).encode(),
                        max_policy_tokens=sampling.max_new_tokens if single else None,
                        private=(task, env))

    def score(self, spec: TaskSpec, record) -> float | None:
        task, env = spec.private
        if not isinstance(env, _SingleTurnEnv):
            return None  # multi-turn: the sampler ran the sandbox; keep its reward
        with env.start(task) as episode:
            return episode.step(record.policy_token_ids().tolist()).reward


def mix_specs(tasks_cfg) -> list[dict]:
    """``tasks.mix`` entries as ``EnvTaskSource`` specs (options flattened into the env kwargs)."""
    return [{"env": m.env, "weight": m.weight, "difficulty": m.difficulty, **m.options}
            for m in tasks_cfg.mix]


@register_task_source("mix")
def _mix(cfg) -> EnvTaskSource:
    s = cfg.sampling
    sampling = SamplingSpec(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, head_k=s.head_k,
                            max_new_tokens=s.max_new_tokens)
    return EnvTaskSource(mix_specs(cfg), seed=cfg.seed, group_size=cfg.group_size,
                         count=cfg.count, sampling=sampling)
