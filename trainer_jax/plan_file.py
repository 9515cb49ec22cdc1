"""``plan.yaml``: the sampler pool ``mixrl-train plan`` recommends, as the trainer and the fleet read it.

``mixrl-train --config C --plan plan.yaml`` and ``mixrl-fleet up --plan plan.yaml`` merge its
``groups:`` (replica counts, accelerators, prices) into a run config (``plan_overrides``); the
planner that writes it (``experiments.plan``) sits above the trainer, so the file's reader lives
here, below both.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import Field, StrictInt, ValidationError

from trainer_jax.config.base import Strict
from trainer_jax.config.yaml_safe import YamlError, read_yaml


class PlanError(ValueError):
    """Bad planner input (run dir, limits, prices, budget) or plan file: one line, exit 2."""


class PlanGroup(Strict):
    """One group of a ``plan.yaml`` (``plan_document`` writes exactly these keys)."""

    name: str = Field(min_length=1, max_length=200)
    processes: StrictInt = Field(ge=0)  # true, 1.5 and "3" are not counts
    accelerator: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:+-]+$")
    price_per_hour: float | None = Field(None, ge=0, allow_inf_nan=False)


class PlanDoc(Strict):
    """What ``--plan`` reads of a ``plan.yaml``: its groups (the other keys say how it was made)."""

    groups: list[PlanGroup]


def read_plan(path: str | Path) -> list[dict]:
    """A ``plan.yaml``'s ``groups:`` list, checked like a config: a mapping with a non-empty
    list of ``{name, processes, accelerator, price_per_hour}`` (names unique strings, counts
    integers >= 0, no other keys), read with the YAML loader's bounds; each problem is one line."""
    from trainer_jax.config import describe

    try:
        tree = read_yaml(path, f"--plan {path}")
    except YamlError as e:
        raise PlanError(str(e)) from None
    if not isinstance(tree, dict) or "groups" not in tree:
        got = ("a mapping without groups" if isinstance(tree, dict) else "an empty file" if tree is None
               else f"a {type(tree).__name__}")
        raise PlanError(f"--plan {path}: needs a mapping with a groups: list of "
                        f"{{name, accelerator, processes, price_per_hour}}, got {got}")
    try:
        groups = PlanDoc.model_validate({"groups": tree["groups"]}).groups
    except ValidationError as e:
        raise PlanError(f"--plan {path}: {describe(e)}") from None
    names = [g.name for g in groups]
    if not groups:
        raise PlanError(f"--plan {path}: its groups: list is empty")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise PlanError(f"--plan {path}: group {twice[0]!r} is listed twice")
    return [g.model_dump() for g in groups]


def plan_overrides(config: str | Path, plan: str | Path) -> list[str]:
    """The config's ``groups:`` with the plan's replica counts, accelerators and prices, as one
    ``groups=[...]`` override for ``load_config`` (which validates the result, the spawned
    processes' cap ``train.max_spawned_samplers`` included). A group the plan gives no replica
    leaves the pool (a group without samplers would still be chosen to run the evaluations); a
    plan group the config lacks is an error."""
    try:
        tree = read_yaml(config, f"config {config}") or {}
    except YamlError as e:
        raise PlanError(str(e)) from None
    current = tree.get("groups") if isinstance(tree, dict) else None
    if not isinstance(current, list) or not current:
        raise PlanError(f"config {config}: no groups: list to apply --plan {plan} to")
    planned = {g["name"]: g for g in read_plan(plan)}
    # A config group's name may be anything until the config validates: match strings only.
    names = [g["name"] for g in current if isinstance(g, dict) and isinstance(g.get("name"), str)]
    unknown = [n for n in planned if n not in names]
    if unknown:
        raise PlanError(f"--plan {plan}: group {unknown[0]!r} is not a group of {config} (its groups: "
                        f"{', '.join(names)})")
    merged = []
    for g in current:
        name = g.get("name") if isinstance(g, dict) else None
        p = planned.get(name) if isinstance(name, str) else None
        if p is None:
            merged.append(g)
            continue
        if p["processes"] == 0:
            continue
        g = {**g, "processes": p["processes"]}
        for key in ("accelerator", "price_per_hour"):
            if p.get(key) is not None:
                g[key] = p[key]
        merged.append(g)
    if not merged:
        raise PlanError(f"--plan {plan} gives every group of {config} zero replicas")
    return ["groups=" + yaml.safe_dump(merged, default_flow_style=True, width=1 << 20).strip()]
