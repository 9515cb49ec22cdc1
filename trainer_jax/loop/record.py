"""The record stage: one step's metrics, its alarms, the episode log and the progress line.

``measure`` collects what the step did (loss and objective diagnostics per sampler group, rewards,
terminations, throughput and idle shares, the probe's per-group mismatch, episode statistics, the
cost ledger's step, which also feeds the router); ``record`` adds the alarms (collapse, probe,
non-finite advantages), prints each new one and writes the step's record to the metrics sink;
``summary`` is the step's progress line.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from trainer_jax.config import RunConfig
from trainer_jax.cost import TrainerCost, status_text
from trainer_jax.diagnostics import CollapseAlarms, MetricsSink, alarm_settle_steps
from trainer_jax.episode_log import EpisodeLog, episode_metrics
from trainer_jax.learner import StepResult
from trainer_jax.loop.batches import Batch, BatchBuilder
from trainer_jax.objective import reduce_metrics
from trainer_jax.progress import StepProgress
from trainer_jax.samplers import LocalSamplers
from trainer_jax.service.probe_report import lag_alarms, probe_line, probe_metrics
from trainer_jax.service.server import RolloutService
from trainer_jax.service.tasks import TaskSource


def step_metrics(group_names: list[str], groups: list, batch: Batch, result: StepResult,
                 batches: BatchBuilder, version: int, wait_s: float, step_s: float,
                 status: dict) -> dict[str, float]:
    """The learner's and the batch's metrics of one step (``status``: the service's)."""
    rewards = batch.rewards
    values: dict[str, float] = {"loss": result.loss, "grad_norm": result.grad_norm,
                                "reward_mean": float(rewards.mean()),
                                "pass_rate": float((rewards > 0).mean()),
                                "samples_trained": len(batch.taken), "samples_carried": len(batches.carry),
                                "samples_dropped_total": batches.carry_dropped,
                                "samples_too_long_total": batches.too_long,
                                "version": version}
    for name, value in reduce_metrics(result.metrics).items():
        arr = np.asarray(value)
        if name.startswith("group/"):
            metric = name.split("/", 1)[1]
            for i, gname in enumerate(group_names):
                values[f"group/{gname}/{metric}"] = float(arr[i])
        else:
            values[name] = float(arr)
    trajectories = [t for g in groups for t in g.trajectories]
    # finish_reason is "termination;errors" (envs.base.finish_reason): the errors are counted
    # per environment by the task source's metrics (env/<entry>/errors/<reason>).
    reasons = Counter(t.finish_reason.partition(";")[0] for t in trajectories)
    for reason, n in reasons.items():
        values[f"termination/{reason}"] = n / len(trajectories)
    by_group = Counter(t.group for t in trajectories)
    for gname in group_names:
        values[f"group/{gname}/sample_share"] = by_group.get(gname, 0) / len(trajectories)
    tokens = sum(int(t.loss_mask.sum()) for t in trajectories)
    total = wait_s + step_s
    values["tokens_per_s"] = tokens / max(total, 1e-9)
    values["trainer_idle_share"] = wait_s / max(total, 1e-9)
    samplers = [s for s in status["samplers"] if not s["revoked"]]
    if samplers:
        values["sampler_idle_share"] = float(np.mean(
            [1 - min(1.0, s["active_samples"] / max(1, s["capacity"])) for s in samplers]))
    for gname, g in status["groups"].items():
        values[f"group/{gname}/tokens_per_s"] = float(g["tokens_per_s"])
    return values


class Recorder:
    """The record stage of process 0's loop (see the module docstring)."""

    def __init__(self, cfg: RunConfig, *, sink: MetricsSink, cost: TrainerCost, service: RolloutService,
                 samplers: LocalSamplers, source: TaskSource, batches: BatchBuilder,
                 episode_log: EpisodeLog):
        self.sink, self.cost, self.service, self.samplers = sink, cost, service, samplers
        self.source, self.batches, self.episode_log = source, batches, episode_log
        self.group_names = [g.name for g in cfg.groups]
        self.alarms = CollapseAlarms(settle_steps=alarm_settle_steps(cfg.optimizer.warmup_steps))
        self._probe_alarms_seen = 0  # probe reports above their bound already printed

    def measure(self, step: int, version: int, groups: list, batch: Batch, result: StepResult,
                wait_s: float, step_s: float) -> dict[str, float]:
        """Step ``step``'s metrics, trained at ``version``; its episodes go to the episode log."""
        status = self.service.status()
        values = step_metrics(self.group_names, groups, batch, result, self.batches, version,
                              wait_s, step_s, status)
        values.update(probe_metrics(status, self.service.probes))
        values.update(self.source.metrics(groups))
        values.update(batch.advantage_metrics)
        values.update(episode_metrics(groups, version))
        self.episode_log.write(step, groups, version)
        values["samplers/restarts"] = self.samplers.restarts
        values.update(self.cost.step(self.service, self.group_names, batch.samples, batch.taken, values))
        return values

    def record(self, step: int, values: dict[str, float], batch: Batch, progress: StepProgress) -> None:
        """Add the alarms to ``values``, print the new ones, write the step's record."""
        alarms = self.alarms.update(values["reward_mean"], values.get("k3"),
                                    values.get("termination/empty_reply", 0.0),
                                    call_rate=values.get("tool/call_rate"))
        alarms += lag_alarms(values)
        for line in self.service.probes.alarms[self._probe_alarms_seen:]:
            progress.print(f"[red]alarm[/red] step {step}: {line}")
        self._probe_alarms_seen = len(self.service.probes.alarms)
        for line in batch.advantage_alarms:
            progress.print(f"[red]alarm[/red] step {step}: {line}")
        for alarm in self.alarms.transitions(alarms):
            progress.print(f"[red]alarm[/red] step {step}: {alarm}")
        values["alarms"] = len(alarms)
        self.sink.write(step, values)

    def summary(self, values: dict[str, float], result: StepResult) -> str:
        """The step's progress line."""
        restarts = self.samplers.restarts
        return (f"reward {values['reward_mean']:.3f} k3 {values.get('k3', float('nan')):.2e} "
                f"oor {values.get('out_of_range', float('nan')):.3f} |g| {result.grad_norm:.2f} "
                f"idle {values['trainer_idle_share']:.0%}" + status_text(values) + probe_line(values)
                + (f" sampler restarts {restarts}" if restarts else ""))


__all__ = ["Recorder", "step_metrics"]
