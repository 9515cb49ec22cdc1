"""The planner's arithmetic: stability limits, and the integer program that picks replica counts.

The problem ``mixrl-train plan`` solves: choose an integer replica count ``n_g >= 0`` for every
group that passed the stability limits, maximising useful samples per hour ``sum n_g * v_g``
subject to ``sum n_g * c_g <= budget`` (``v_g``: useful samples per replica-hour, ``c_g``: USD per
replica-hour). That is an integer (unbounded) knapsack. Greedy by useful samples per dollar is
*not* optimal for it (budget 10, A costs 6 for 7, B costs 5 for 5.5: greedy buys one A for 7, two
B give 11), so ``solve`` is exact: depth-first branch and bound over the counts, groups in order
of value per dollar, most replicas first, pruning a branch when its LP-relaxation bound (the
remaining budget spent fractionally at the best remaining value per dollar, an upper bound on
every integer completion) cannot beat the best plan found. Every plan not pruned is evaluated and
a pruned branch provably holds nothing better, so the result is optimal; a mixed fleet has a
handful of groups and the bound prunes nearly everything (tests compare it with brute force).
"""

from __future__ import annotations

import dataclasses
import math
from importlib import resources
from pathlib import Path

from trainer_jax.config.yaml_safe import YamlError, load_yaml, read_text, short
from trainer_jax.plan_file import PlanError

#: limit name -> (what it bounds, the measurement it is checked against)
# The k3 keys measure trained samples: sampler vs the trainer's *current* policy, so they include
# the drift of stale samples (asynchronous runs), not only what the precision adds; the probe KL
# and the out-of-range share are the precision's own (the default limits use only those).
LIMIT_KEYS: dict[str, str] = {
    "max_k3": "the group's mean k3 of trained samples (staleness included)",
    "max_k3_ratio": "the group's mean k3 over the lowest group's in the same run (staleness included)",
    "max_k3_growth": "the group's mean k3 over the run's last third / its first (staleness included)",
    "max_out_of_range": "the group's share of policy tokens with ratio outside [c_min, c_max] "
                        "(staleness included)",
    "max_out_of_range_added": "the group's out-of-range share over that of the run's group with the "
                              "lowest probe KL (what its precision adds: the shared stale part cancels)",
    "max_staleness": "the group's mean staleness (trainer versions behind) of trained samples",
    "max_probe_kl": "the group's mean version-probe KL",
}
#: keys a limits file may carry beside the limits: provenance, printed or kept, never checked
INFO_KEYS = ("source", "warning", "runs", "generated_by", "notes")
DEFAULT_LIMITS = "plan_limits.yaml"  # package data of experiments: precision-only limits
#: ``--limits NAME`` for the package's named alternatives
NAMED_LIMITS = {"writeup": "plan_limits_writeup.yaml"}


@dataclasses.dataclass
class Limits:
    """Stability limits (None: no limit) and where they came from."""

    values: dict[str, float | None]
    source: str
    path: str
    warning: str = ""

    def describe(self) -> str:
        set_ = ", ".join(f"{k}={v:g}" for k, v in self.values.items() if v is not None) or "none"
        return f"limits from {self.path}: {self.source} ({set_})"


def load_limits(path: str | Path | None = None) -> Limits:
    """A limits file (YAML: ``source:`` and ``max_*`` keys); None: the package's default (probe KL
    and out-of-range share); a name of ``NAMED_LIMITS`` (``writeup``): that package file."""
    try:  # bounded, a regular file, no alias bomb (trainer_jax.config.yaml_safe)
        if path is None or str(path) in NAMED_LIMITS:
            name = DEFAULT_LIMITS if path is None else NAMED_LIMITS[str(path)]
            where = f"experiments/{name}" + (" (default)" if path is None else "")
            text = resources.files("experiments").joinpath(name).read_text()
        else:
            where = str(path)
            text = read_text(path, f"--limits {where}")
        tree = load_yaml(text, f"--limits {where}")
    except YamlError as e:
        raise PlanError(str(e)) from None
    if not isinstance(tree, dict):
        raise PlanError(f"--limits {where}: must be a mapping of max_* keys with a source: label")
    unknown = sorted(set(tree) - set(LIMIT_KEYS) - set(INFO_KEYS), key=str)  # keys of any type
    if unknown:
        raise PlanError(f"--limits {where}: unknown key {short(unknown[0], 60)} (limits: "
                        f"{', '.join(LIMIT_KEYS)})")
    if not isinstance(tree.get("source"), str) or not tree["source"].strip():
        raise PlanError(f"--limits {where}: needs a source: label saying where its figures come from")
    values: dict[str, float | None] = {}
    for key in LIMIT_KEYS:
        v = tree.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or not 0 <= v < math.inf):
            raise PlanError(f"--limits {where}: {key} must be a number >= 0 or null, got {short(v)}")
        values[key] = None if v is None else float(v)
    return Limits(values, " ".join(tree["source"].split()), where,
                  " ".join(str(tree.get("warning") or "").split()))


def check_limits(measured: dict[str, float | None], limits: Limits) -> list[str]:
    """The limits a group's measurements break, as ``"k3 0.21 > max_k3 0.16"``; an unmeasured
    value (None / NaN) breaks nothing (the table shows it as unmeasured)."""
    broken = []
    for key, bound in limits.values.items():
        value = measured.get(key.removeprefix("max_"))
        if bound is None or value is None or math.isnan(value):
            continue
        if value > bound:
            broken.append(f"{key.removeprefix('max_')} {value:.3g} > {key} {bound:.3g}")
    return broken


@dataclasses.dataclass(frozen=True)
class Item:
    """One plannable group: useful samples per replica-hour and USD per replica-hour."""

    name: str
    value: float
    cost: float
    max_count: int | None = None  # None: as many as the budget buys


def solve(items: list[Item], budget: float) -> tuple[dict[str, int], float, float]:
    """Exact: the replica counts maximising total value within ``budget`` (ties: the cheaper
    plan); returns ``(counts, value, cost)``. See the module docstring for why it is optimal."""
    if not math.isfinite(budget) or budget < 0:
        raise PlanError(f"--budget must be a finite USD per hour >= 0, got {budget}")
    for it in items:
        if not it.cost > 0 or not math.isfinite(it.cost):
            raise PlanError(f"group {it.name!r}: price {it.cost} per replica-hour; the planner needs "
                            "a positive price (a free group makes the plan unbounded)")
        if not it.value >= 0 or not math.isfinite(it.value):
            raise PlanError(f"group {it.name!r}: useful samples per hour {it.value} is not a number >= 0")
    order = sorted((it for it in items if it.value > 0),
                   key=lambda it: (-it.value / it.cost, it.cost, it.name))
    eps = 1e-9 * max(1.0, budget)
    best: dict = {"value": 0.0, "cost": 0.0, "counts": [0] * len(order)}
    counts = [0] * len(order)

    def bound(i: int, left: float) -> float:
        total = 0.0
        for it in order[i:]:
            n = left / it.cost if it.max_count is None else min(left / it.cost, it.max_count)
            total += n * it.value
            left -= n * it.cost
            if left <= eps:
                break
        return total

    def better(value: float, cost: float) -> bool:
        tol = 1e-9 * max(1.0, best["value"])
        return value > best["value"] + tol or (abs(value - best["value"]) <= tol
                                               and cost < best["cost"] - eps)

    def visit(i: int, left: float, value: float) -> None:
        if i == len(order):
            if better(value, budget - left):
                best.update(value=value, cost=budget - left, counts=list(counts))
            return
        if value + bound(i, left) < best["value"] - 1e-9 * max(1.0, best["value"]):
            return  # nothing below this node can reach the best plan
        it = order[i]
        top = int(math.floor((left + eps) / it.cost))
        if it.max_count is not None:
            top = min(top, it.max_count)
        for n in range(top, -1, -1):
            counts[i] = n
            visit(i + 1, left - n * it.cost, value + n * it.value)
        counts[i] = 0

    visit(0, budget, 0.0)
    chosen = dict(zip((it.name for it in order), best["counts"], strict=True))
    return ({it.name: chosen.get(it.name, 0) for it in items}, best["value"], best["cost"])
