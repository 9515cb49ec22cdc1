"""The evaluate stage: pass@1 / pass@k of the newest published version, run by the fleet's
evaluation group (``trainer_jax.evaluation``), at the start, every ``train.eval_every`` steps and
at the end. An evaluation that times out is skipped with one line; the run goes on."""

from __future__ import annotations

from rich.console import Console

from trainer_jax.config import RunConfig
from trainer_jax.evaluation import FleetEvaluator
from trainer_jax.progress import Phase
from trainer_jax.service.server import RolloutService
from trainer_jax.service.tasks import EnvTaskSource


class Evaluation:
    """``evaluation(label, version)`` -> the metrics (``{}`` when off or skipped)."""

    def __init__(self, cfg: RunConfig, source: EnvTaskSource, service: RolloutService, console: Console):
        self.fleet = FleetEvaluator(cfg, source, service)
        self.every, self.steps, self.k = cfg.train.eval_every, cfg.run.steps, cfg.train.eval_k
        self.console = console

    def due(self, step: int) -> bool:
        """Whether step ``step`` ends with an evaluation (the last step's is the final one)."""
        return bool(self.every) and step % self.every == 0 and step < self.steps

    def __call__(self, label: str, version: int) -> dict[str, float]:
        if not self.fleet.enabled:
            return {}
        try:
            with Phase(self.console, f"eval ({label})"):
                result = self.fleet.evaluate(version)
        except TimeoutError as e:
            self.console.print(f"[yellow]eval ({label}) skipped[/yellow]: {e}")
            return {}
        self.console.print(f"eval ({label}): pass@1 {result['eval/pass@1']:.3f}, "
                           f"pass@{self.k} {result[f'eval/pass@{self.k}']:.3f}")
        return result


__all__ = ["Evaluation"]
