"""What the fleet runs, from the run config the trainer reads: one ``GroupSpec`` per group.

The fleet runs the config's ``spawn: false`` groups (a ``spawn: true`` group is the trainer's own
child processes; running it here too would double it). Replica counts are the groups'
``processes`` (after a ``plan.yaml`` when one is given, ``trainer_jax.plan_file.plan_overrides``);
``min_processes`` / ``max_processes`` bound the autoscaler. Ray-free and torch-free.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from trainer_jax.config import ConfigError, RunConfig, SamplerGroupConfig, load_config

# Accelerator names that are Ray's own resources (or mean "no accelerator"): never a custom resource.
_BUILTIN = {"cpu", "gpu", "memory", "object_store_memory", "none"}
# Keys of a group's ``resources:`` that are Ray options rather than custom resources.
_RAY_OPTIONS = ("num_cpus", "num_gpus", "memory")


class FleetError(ValueError):
    """Bad fleet input (config, plan, arguments): one line, exit 2."""


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """One group as the fleet runs it: how to start a replica and how many."""

    name: str
    replicas: int
    min_replicas: int
    max_replicas: int
    accelerator: str | None
    price_per_hour: float | None
    resources: dict[str, float]
    capacity: int
    weight_format: str
    sampler_args: tuple[str, ...]  # mixrl-sample's arguments but --trainer, --model-dir, --name

    def ray_options(self) -> dict:
        """The Ray actor options of one replica: ``num_cpus`` / ``num_gpus`` / ``memory`` from
        ``resources`` (``num_cpus`` 1 when absent), the other keys and the accelerator (one per
        GPU asked, else 1) as custom resources."""
        res = dict(self.resources)
        opts: dict = {"num_cpus": res.pop("num_cpus", 1.0)}
        if res.get("num_gpus"):
            opts["num_gpus"] = res.pop("num_gpus")
        res.pop("num_gpus", None)
        if "memory" in res:
            opts["memory"] = int(res.pop("memory"))
        custom = dict(res)
        if self.accelerator and self.accelerator.lower() not in _BUILTIN:
            custom[self.accelerator] = custom.get(self.accelerator, opts.get("num_gpus") or 1.0)
        if custom:
            opts["resources"] = custom
        return opts


def sampler_args(g: SamplerGroupConfig, episode_tokens: int) -> tuple[str, ...]:
    """``mixrl-sample``'s arguments for a replica of ``g`` (the trainer's spawned command,
    ``trainer_jax.samplers.sampler_command``, without what differs per replica and node)."""
    args = ["--group", g.name, "--recipe", g.recipe, "--capacity", str(g.capacity),
            "--threads", str(g.threads), "--episode-tokens", str(episode_tokens),
            "--device", g.device, "--compile", g.compile]
    if g.accelerator:
        args += ["--accelerator", g.accelerator]
    for key in ("attention", "kv_cache_dtype", "logit_noise"):
        if getattr(g, key) is not None:
            args += ["--recipe-override", f"{key}={getattr(g, key)}"]
    if g.round_weights is not None:
        args += ["--recipe-override", f"round_weights={g.round_weights.bits}/{g.round_weights.block_size}"]
    return tuple(args)


def load_fleet_config(config: str | Path, plan: str | Path | None = None,
                      overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """The run config with the plan's replica counts merged (``mixrl-train --plan``'s rule)."""
    from trainer_jax.plan_file import PlanError, plan_overrides

    try:
        extra = plan_overrides(config, plan) if plan else []
        return load_config(config, [*extra, *overrides])
    except (ConfigError, PlanError) as e:
        raise FleetError(str(e)) from None


def fleet_groups(cfg: RunConfig) -> list[GroupSpec]:
    """The ``spawn: false`` groups of ``cfg`` as ``GroupSpec``s; none is an error."""
    groups = [g for g in cfg.groups if not g.spawn]
    if not groups:
        raise FleetError("every group of the config has spawn: true (the trainer starts those itself); "
                         "set spawn: false on the groups the fleet runs")
    out = []
    for g in groups:
        lo = g.min_processes if g.min_processes is not None else g.processes
        hi = g.max_processes if g.max_processes is not None else g.processes
        out.append(GroupSpec(
            name=g.name, replicas=g.processes, min_replicas=lo, max_replicas=hi,
            accelerator=g.accelerator, price_per_hour=cfg.price_of(g), resources=dict(g.resources),
            capacity=g.capacity, weight_format=g.weight_format,
            sampler_args=sampler_args(g, cfg.train.episode_tokens)))
    return out


def read_token(token_file: str | None, env: dict | None = None) -> str:
    """The bearer token from ``token_file`` or ``$MIXRL_TOKEN``; missing is a ``FleetError``."""
    import os

    env = os.environ if env is None else env
    from mixrl_wire.token_file import TokenFileError, read_token_text

    try:  # bounded and never blocking (mixrl_wire.token_file)
        token = read_token_text(token_file) if token_file else env.get("MIXRL_TOKEN", "").strip()
    except TokenFileError as e:
        raise FleetError(f"--token-file: {e}") from None
    if token is None:
        raise FleetError(f"--token-file {token_file}: No such file or directory")
    if not token:
        raise FleetError("no bearer token: set MIXRL_TOKEN or pass --token-file")
    return token


def python() -> str:
    """The interpreter replicas run under: this one (a Ray node runs the same environment)."""
    return sys.executable
