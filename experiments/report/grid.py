"""The sweep grid as the report lays it out: runs by (pool, condition) in a fixed order, per-cell counts."""

from __future__ import annotations

import dataclasses
import math

from experiments.report.runs import REWARD_FLOOR, RunResult, grid_order, mean_over_seeds


@dataclasses.dataclass(frozen=True)
class Grid:
    """Every cell's runs (failed ones included) keyed by ``(pool, condition)``, with the drift analysis."""

    results: list[RunResult]
    labels: dict[str, str]
    pools: list[str]
    conds: list[str]
    by: dict[tuple[str, str], list[RunResult]]
    drift: dict[str, dict]

    @classmethod
    def of(cls, results: list[RunResult], labels: dict[str, str], drift: dict[str, dict]) -> Grid:
        """Group ``results`` by cell, pools and conditions in the report's order."""
        pools, conds = grid_order(results, labels)
        by = {(p, c): [r for r in results if r.pool == p and r.condition == c] for p in pools for c in conds}
        return cls(results, labels, pools, conds, by, drift)

    @property
    def ok(self) -> list[RunResult]:
        """The runs that finished."""
        return [r for r in self.results if r.ok]

    @property
    def steps(self) -> int:
        """The longest finished run's RL steps (0 if none finished)."""
        return max((r.steps for r in self.ok), default=0)

    def label(self, cond: str) -> str:
        """A condition's display name (its key when the sweep gives none)."""
        return self.labels.get(cond, cond)

    def runs(self, pool: str, cond: str) -> list[RunResult]:
        """The finished runs of one cell."""
        return [r for r in self.by.get((pool, cond), []) if r.ok]

    def collapsed(self, pool: str, cond: str) -> tuple[int, int]:
        """How many of a cell's finished runs collapsed, and how many finished."""
        rs = self.runs(pool, cond)
        return sum(r.collapse_step is not None for r in rs), len(rs)

    def first_collapse(self, pool: str, cond: str) -> int:
        """The earliest collapse step among a cell's runs (call only when one collapsed)."""
        return min(r.collapse_step for r in self.runs(pool, cond) if r.collapse_step)

    @staticmethod
    def signal(rs: list[RunResult]) -> bool:
        """Whether any run had a reward to lose (else collapse and matching are not assessable)."""
        return any(
            max((x.get("reward_mean") or 0.0) for x in r.records) > 5 * REWARD_FLOOR for r in rs if r.records
        )

    def pool_ratio(self, cond: str, attr: str) -> float | None:
        """Seed-mean ``attr`` on the mixed pool over the homogeneous pool's (None if undefined)."""
        m = mean_over_seeds(self.runs("mixed", cond), attr)
        h = mean_over_seeds(self.runs("homogeneous", cond), attr)
        if m and h and not (math.isnan(m) or math.isnan(h)) and h > 0:
            return m / h
        return None
