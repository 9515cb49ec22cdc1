"""Held-out evaluation through the sampler fleet: pass@1 and pass@k of the current policy.

Evaluation is a mode of the rollout side, not a second inference stack in the trainer process:
held-out tasks (their own seed and id prefix, so they never coincide with training tasks) are
queued as *evaluation* tasks, leased to one group (``RunConfig.eval_group``, by default a bf16
one) once its samplers hold the version being evaluated, scored by the same trainer-side path as
training samples, and never trained on.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from trainer_jax.config import RunConfig
from trainer_jax.service.server import RolloutService
from trainer_jax.service.tasks import EnvTaskSource


class FleetEvaluator:
    def __init__(self, cfg: RunConfig, source: EnvTaskSource, service: RolloutService):
        self.cfg, self.source, self.service = cfg.train, source, service
        self.group = cfg.eval_group
        # One head entry per token is all the validator needs; the record stays small.
        self.sampling = dataclasses.replace(cfg.tasks.sampling, head_k=1)

    @property
    def enabled(self) -> bool:
        return self.cfg.eval_tasks > 0 and self.group is not None

    def evaluate(self, version: int) -> dict[str, float]:
        """pass@1 and pass@k (``train.eval_k`` samples per task) of weights ``version``."""
        if not self.enabled:
            return {}
        k = self.cfg.eval_k
        specs = [self.source.spec(n, group_size=k, sampling=self.sampling, evaluation=True,
                                  group=self.group, min_version=version)
                 for n in range(self.cfg.eval_tasks)]
        groups = self.service.evaluate(specs, timeout=self.cfg.eval_timeout_s)
        wins = np.asarray([[(t.reward or 0.0) > 0 for t in g.trajectories] for g in groups], np.float64)
        return {"eval/pass@1": float(wins.mean()), f"eval/pass@{k}": float(wins.max(axis=1).mean())}
