"""Run configs: YAML files validated by pydantic models, with ``key.sub=value`` overrides.

One config system for every entry point. Unknown keys are errors (a typo must not silently fall
back to a default), and every error names the offending key. Importing the schema loads neither
JAX nor torch: the rollout service and the launchers use it too. Sections by module:
``learning`` (model, objective, optimizer, warm start), ``run`` (the loop, groups, tasks),
``service`` (the rollout service), ``parallel`` (mesh, multi-process).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from trainer_jax.config.base import ConfigError
from trainer_jax.config.base import Strict as _Strict
from trainer_jax.config.learning import ModelConfig, ObjectiveConfig, OptimizerConfig, SFTConfig
from trainer_jax.config.overrides import apply_override
from trainer_jax.config.parallel import DistributedConfig, MeshConfig
from trainer_jax.config.run import MixEntry, RunSection, SamplerGroupConfig, TasksConfig, TrainConfig
from trainer_jax.config.service import (
    BufferConfig,
    ProbeConfig,
    RouterConfig,
    ServiceConfig,
    ServiceLimitsConfig,
    TLSConfig,
)
from trainer_jax.config.shape_checks import check_context_rows, check_kept_sets, check_wire_limits
from trainer_jax.config.yaml_safe import YamlError, read_yaml, short


class WandbConfig(_Strict):
    project: str
    mode: Literal["offline", "online"] = "offline"


class LoggingConfig(_Strict):
    """Metric sinks beside ``metrics.jsonl`` and TensorBoard."""

    wandb: WandbConfig | None = None  # the optional ``wandb`` extra

    @model_validator(mode="after")
    def _installed(self) -> LoggingConfig:
        import importlib.util

        if self.wandb is not None and importlib.util.find_spec("wandb") is None:
            raise ValueError("logging.wandb: the wandb package is not installed (pip install 'mixrl[wandb]')")
        return self


#: The groups a config without ``groups:`` gets (as a tree: validated with the rest of the config).
DEFAULT_GROUPS = ({"name": "bf16"},)


class RunConfig(_Strict):
    run: RunSection = RunSection()
    model: ModelConfig = ModelConfig()
    groups: list[SamplerGroupConfig] = Field(
        default_factory=lambda: [SamplerGroupConfig(**g) for g in DEFAULT_GROUPS])
    service: ServiceConfig = ServiceConfig()
    tasks: TasksConfig = TasksConfig()
    train: TrainConfig = TrainConfig()
    objective: ObjectiveConfig = ObjectiveConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    sft: SFTConfig = SFTConfig(steps=0)
    mesh: MeshConfig = MeshConfig()
    distributed: DistributedConfig = DistributedConfig()
    logging: LoggingConfig = LoggingConfig()
    # USD per replica-hour by accelerator name (a group's ``accelerator``); a group's own
    # ``price_per_hour`` wins. ``mixrl-train --prices FILE`` merges a file's table over this one.
    prices: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _priced_groups(self) -> RunConfig:
        for key, usd in self.prices.items():
            if not usd >= 0 or usd == float("inf"):
                raise ValueError(f"prices.{key}: must be a finite USD per hour >= 0, got {usd}")
        router = self.service.router
        if router.policy == "cost":
            unpriced = [g.name for g in self.groups if self.price_of(g) is None]
            if unpriced:
                raise ValueError(f"service.router.policy cost: group {unpriced[0]!r} has no price (set its "
                                 "price_per_hour, or its accelerator with an entry in prices:)")
            free = [g.name for g in self.groups if self.price_of(g) == 0]
            if free:  # useful samples per dollar has no finite value: the router would floor it
                raise ValueError(f"service.router.policy cost: group {free[0]!r} costs 0 USD/h, so it has "
                                 "no useful samples per dollar to route by (give it a price > 0, or use "
                                 "policy throughput)")
        if self.groups and router.max_share * len(self.groups) < 1:
            raise ValueError(f"service.router.max_share ({router.max_share}) x {len(self.groups)} groups "
                             "is below 1: the leases cannot all be placed")
        return self

    def price_of(self, group: SamplerGroupConfig) -> float | None:
        """USD per replica-hour of ``group``: its own price, else the table's for its accelerator,
        else None (no USD figures for the group, not zero)."""
        if group.price_per_hour is not None:
            return group.price_per_hour
        return self.prices.get(group.accelerator) if group.accelerator else None

    def group_prices(self) -> dict[str, float | None]:
        """``{group name: USD per replica-hour or None}`` for every group."""
        return {g.name: self.price_of(g) for g in self.groups}

    @model_validator(mode="after")
    def _unique_group_names(self) -> RunConfig:
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"sampler group names must be unique, got {names}")
        if self.train.eval_group is not None and self.train.eval_group not in names:
            raise ValueError(f"train.eval_group {self.train.eval_group!r} is not a group; groups: {names}")
        return self

    @model_validator(mode="after")
    def _eval_only_groups(self) -> RunConfig:
        only = [g.name for g in self.groups if g.eval_only]
        if not only:
            return self
        if self.train.eval_tasks == 0:
            raise ValueError(f"groups: {only[0]!r} is eval_only but no evaluation is configured "
                             "(train.eval_tasks: 0)")
        if len(only) == len(self.groups):
            raise ValueError("groups: every group is eval_only; at least one must lease training tasks")
        if self.train.eval_group is not None and self.train.eval_group not in only:
            raise ValueError(f"groups: {only[0]!r} is eval_only but train.eval_group is "
                             f"{self.train.eval_group!r}: it would lease nothing")
        return self

    @model_validator(mode="after")
    def _spawned_samplers_capped(self) -> RunConfig:
        spawned = {g.name: g.processes for g in self.groups if g.spawn and g.processes}
        total, cap = sum(spawned.values()), self.train.max_spawned_samplers
        if total > cap:
            most = sorted(spawned.items(), key=lambda x: -x[1])
            each = ", ".join(f"{short(n, 40)}: {k}" for n, k in most[:4]) + (", ..." if len(most) > 4 else "")
            raise ValueError(f"groups: {total:,} sampler processes to spawn on this host ({each}) is over "
                             f"train.max_spawned_samplers {cap}; lower the groups' processes, or raise "
                             f"train.max_spawned_samplers if this host can run them")
        return self

    @model_validator(mode="after")
    def _warm_start_has_demonstrations(self) -> RunConfig:
        if self.sft.steps > 0 and any(m.env == "dataset" for m in self.tasks.mix_entries()):
            raise ValueError("sft.steps: dataset tasks have no demonstrations to warm-start on "
                             "(set sft.steps: 0)")
        if self.sft.steps > 0:
            from envs.loading import has_demonstration, resolve_env

            for m in self.tasks.mix_entries():
                if not has_demonstration(resolve_env(m.env)):
                    raise ValueError(f"sft.steps: environment {m.name!r} ({m.env}) writes no "
                                     "demonstrations to warm-start on (set sft.steps: 0)")
        return self

    @model_validator(mode="after")
    def _kept_sets_fit(self) -> RunConfig:
        check_kept_sets(self)
        return self

    @model_validator(mode="after")
    def _long_rows_fit_the_wire(self) -> RunConfig:
        check_wire_limits(self)
        check_context_rows(self)
        return self

    @model_validator(mode="after")
    def _kernel_option_names(self) -> RunConfig:
        # A misspelt objective.kernel_options name (block_vv) failed at the first step: the names
        # are its implementation's keyword parameters (impl auto: those some implementation
        # takes). Checked for a run's config; an ObjectiveConfig built alone is checked at its call.
        options = self.objective.kernel_options
        if not options:
            return self
        from trainer_jax.kernels.linear_logsumexp.api import IMPLS, _impl_options

        impl = self.objective.impl
        impls = list(IMPLS) if impl == "auto" else [impl]
        known = sorted(set().union(*(_impl_options(IMPLS[i]) for i in impls)))
        unknown = [k for k, _ in options if k not in known]
        if unknown:
            raise ValueError(f"objective.kernel_options: impl {impl} takes no option {unknown[0]!r}; "
                             f"it takes {', '.join(known) or 'none'}")
        return self

    @property
    def eval_group(self) -> str | None:
        """The group that runs evaluations (see ``TrainConfig.eval_group``); None without groups."""
        if self.train.eval_group is not None:
            return self.train.eval_group
        only = [g.name for g in self.groups if g.eval_only]
        if only:  # a group that leases nothing but evaluation is there to run it
            return only[0]
        bf16 = [g for g in self.groups if g.weight_format == "bf16"]
        # A bf16 group without a mismatch dial measures the policy itself (up to bf16 rounding).
        clean = [g.name for g in bf16 if g.round_weights is None and not g.logit_noise]
        return (clean or [g.name for g in bf16] or [g.name for g in self.groups] or [None])[0]

    def weight_formats(self) -> list[str]:
        """Formats published with every version: bf16 (the lingua franca) and each group's."""
        return list(dict.fromkeys(["bf16", *(g.weight_format for g in self.groups)]))


def read_prices(path: str | os.PathLike) -> dict[str, float]:
    """A price table file (YAML or JSON): a mapping accelerator -> USD per replica-hour."""
    p = Path(path)
    try:
        table = read_yaml(p, f"--prices {p}")
    except YamlError as e:
        raise ConfigError(str(e)) from None
    if not isinstance(table, dict) or not table:
        raise ConfigError(f"--prices {p}: must be a non-empty mapping accelerator: USD per hour")
    for key, usd in table.items():
        if isinstance(usd, bool) or not isinstance(usd, (int, float)) or not 0 <= usd < float("inf"):
            raise ConfigError(f"--prices {p}: {str(key)[:60]}: must be a number of USD per hour >= 0, "
                              f"got {short(usd)}")
    return {str(k): float(v) for k, v in table.items()}


def load_config(path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = (),
                prices: str | os.PathLike | None = None) -> RunConfig:
    """The validated run config of ``path`` with ``overrides``; ``prices``: a price table file
    merged over the config's ``prices:`` (``read_prices``)."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:  # bounded, a regular file, no alias bomb (trainer_jax.config.yaml_safe)
            tree = read_yaml(p, f"config file {p}")
        except YamlError as e:
            raise ConfigError(str(e)) from None
        if tree is None:
            tree = {}
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {p}: top level must be a mapping of sections, got a "
                              f"{type(tree).__name__}")
    # groups[NAME].key=... on a config that keeps the default groups picks among those (as trees:
    # building them here would validate them outside the error handling below)
    defaults = {"groups": [dict(g) for g in DEFAULT_GROUPS]}
    for override in overrides:
        apply_override(tree, override, defaults)
    if prices is not None:
        table = read_prices(prices)
        if not isinstance(tree.get("prices", {}), dict):
            raise ConfigError("prices: must be a mapping accelerator: USD per hour")
        tree["prices"] = {**tree.get("prices", {}), **table}
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(f"invalid config{f' {path}' if path else ''}: {describe(e)}") from None
    except (ValueError, TypeError, OSError) as e:  # raised past pydantic by a validator's helper
        raise ConfigError(f"invalid config{f' {path}' if path else ''}: {' '.join(str(e).split())[:2000]}") \
            from None


def describe(e: ValidationError) -> str:
    """Pydantic's errors as one line, each ``key.path: problem`` (a validator's ``ValueError``
    without pydantic's "Value error, " prefix; the value given, for a wrong type)."""
    problems = []
    for err in e.errors():
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] in ("bool_type", "bool_parsing"):
            msg = "must be true or false"
        if err["type"].endswith(("_type", "_parsing", "literal_error", "enum")) and "input" in err:
            msg += f", got {short(err['input'])}"  # short: never the repr of a huge value
        if len(msg) > 600:  # a validator that quoted a long value: its start and its advice
            msg = f"{msg[:300]} ... {msg[-250:]}"
        loc = ".".join(str(x) for x in err["loc"])
        problems.append(f"{loc}: {msg}" if loc else msg)  # a whole-config check names its keys
    return " ".join("; ".join(problems).split())


__all__ = ["BufferConfig", "ConfigError", "DistributedConfig", "MeshConfig", "MixEntry", "ModelConfig",
           "ObjectiveConfig", "OptimizerConfig", "ProbeConfig", "RouterConfig", "RunConfig", "RunSection",
           "SFTConfig", "SamplerGroupConfig", "ServiceConfig", "ServiceLimitsConfig", "TLSConfig",
           "TasksConfig", "TrainConfig", "apply_override", "load_config", "read_prices"]
