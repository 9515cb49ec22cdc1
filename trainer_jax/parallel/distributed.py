"""Multi-process JAX from the run config and the environment (``jax.distributed.initialize``).

One process per host: a TPU VM of a slice, or a GPU node (one process driving all its GPUs; or
one per GPU with ``local_device_ids``). Call ``init_distributed(cfg.distributed)`` first thing,
before anything touches a device. Precedence: ``MIXRL_*`` environment variables, then the config
fields, then JAX's own detection (Cloud TPU metadata, SLURM, Open MPI, ``JAX_COORDINATOR_ADDRESS``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

import jax

from trainer_jax.config import DistributedConfig

log = logging.getLogger("mixrl.parallel")

ENV_VARS = {
    "coordinator_address": "MIXRL_COORDINATOR_ADDRESS",
    "num_processes": "MIXRL_NUM_PROCESSES",
    "process_id": "MIXRL_PROCESS_ID",
    "local_device_ids": "MIXRL_LOCAL_DEVICE_IDS",
}


@dataclasses.dataclass(frozen=True)
class DistributedInfo:
    """What ``init_distributed`` did and the resulting process layout."""

    initialized: bool
    reason: str
    process_index: int
    process_count: int
    local_device_count: int
    device_count: int


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw in (None, ""):
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def detect_launcher(env: Mapping[str, str]) -> str | None:
    """The multi-process launcher this process was started by, if any (cheap, env-only checks)."""
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(v in env for v in slurm) and (_int_env(env, "SLURM_NTASKS") or 1) > 1:
        return "slurm"
    if (_int_env(env, "OMPI_COMM_WORLD_SIZE") or 1) > 1:
        return "openmpi"
    hosts = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES") or ""
    if "," in hosts or env.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return "tpu"
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return "jax-env"
    return None


def resolve(cfg: DistributedConfig, env: Mapping[str, str]) -> tuple[dict[str, Any] | None, str]:
    """``(kwargs for jax.distributed.initialize, reason)``; kwargs is None for one process."""
    if cfg.mode == "off":
        return None, "distributed.mode=off"
    fields: dict[str, Any] = {
        "coordinator_address": env.get(ENV_VARS["coordinator_address"]) or cfg.coordinator_address,
        "num_processes": _int_env(env, ENV_VARS["num_processes"]) or cfg.num_processes,
        "process_id": _int_env(env, ENV_VARS["process_id"]),
        "local_device_ids": cfg.local_device_ids,
    }
    if fields["process_id"] is None:
        fields["process_id"] = cfg.process_id
    if (ids := env.get(ENV_VARS["local_device_ids"])) not in (None, ""):
        fields["local_device_ids"] = [int(i) for i in ids.split(",")]
    if fields["num_processes"] == 1 and cfg.mode == "auto":
        return None, "num_processes=1"
    if (fields["process_id"] is not None and fields["num_processes"] is not None
            and not 0 <= fields["process_id"] < fields["num_processes"]):
        raise ValueError(f"process_id {fields['process_id']} is outside [0, {fields['num_processes']})")
    kwargs = {k: v for k, v in fields.items() if v is not None}
    kwargs["initialization_timeout"] = cfg.initialization_timeout_s
    kwargs["heartbeat_timeout_seconds"] = max(100, 2 * cfg.heartbeat_timeout_s + 10)
    if cfg.mode == "on":
        return kwargs, "distributed.mode=on"
    if fields["coordinator_address"] is not None or fields["num_processes"] is not None:
        return kwargs, "coordinator configured"
    launcher = detect_launcher(env)
    if launcher is not None:
        return kwargs, f"{launcher} launcher detected"
    return None, "one process (no coordinator configured, no multi-process launcher detected)"


def init_distributed(cfg: DistributedConfig | None = None, *,
                     env: Mapping[str, str] | None = None) -> DistributedInfo:
    """Initialise multi-process JAX if the config / environment asks for it (idempotent)."""
    cfg = cfg if cfg is not None else DistributedConfig()
    env = os.environ if env is None else env
    if jax.distributed.is_initialized():
        initialized, reason = True, "already initialised"
    else:
        kwargs, reason = resolve(cfg, env)
        initialized = kwargs is not None
        if initialized:
            if env.get("JAX_PLATFORMS", "").split(",")[0] == "cpu" and not env.get(
                    "JAX_CPU_COLLECTIVES_IMPLEMENTATION"):
                # Multi-process CPU (tests, laptops): cross-process collectives need gloo.
                jax.config.update("jax_cpu_collectives_implementation", "gloo")
            log.info("jax.distributed.initialize(%s) (%s)", kwargs, reason)
            jax.distributed.initialize(**kwargs)
    info = DistributedInfo(initialized, reason, jax.process_index(), jax.process_count(),
                           jax.local_device_count(), jax.device_count())
    log.info("process %d of %d, %d local of %d devices (%s)", info.process_index, info.process_count,
             info.local_device_count, info.device_count, reason)
    return info
