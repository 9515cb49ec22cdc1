"""Sampler device specs (``mixrl-sample --device``, ``groups[].device``), torch-free.

Both sides read them: the sampler resolves a spec to a torch device (``sampler_torch.device``),
the trainer validates ``groups[].device`` when a config loads and refuses a spawned group that
would share a GPU with a JAX process that preallocates most of it (``gpu_sharing_problem``).
Every rule here is a pure function of its arguments, so it is tested on a machine without GPUs.

``auto`` is the local GPU when one is visible, else the CPU. "Local" follows the launcher: under
torchrun (``LOCAL_RANK``) or SLURM (``SLURM_LOCALID``) process ``r`` of a host takes the ``r``-th
*visible* device, so samplers started side by side spread over the GPUs instead of piling onto
the first one; a process that sees exactly one device (Ray, SLURM ``--gpus-per-task`` and any
other launcher that sets ``CUDA_VISIBLE_DEVICES`` per process) takes that one whatever its rank.
CUDA numbers only the devices ``CUDA_VISIBLE_DEVICES`` leaves visible, so ``cuda:N`` and the rank
are indices into that list, never physical ids.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Iterable, Mapping

_SPEC = re.compile(r"^(auto|cpu|cuda)(?::(\d+))?$")
#: XLA's default share of each visible GPU that JAX preallocates at start-up
JAX_DEFAULT_MEM_FRACTION = 0.75


class DeviceError(ValueError):
    """A device spec that is malformed or names a device this process cannot see."""


def check_spec(spec: str) -> str:
    """``spec`` if it is ``auto``, ``cpu``, ``cuda`` or ``cuda:N``; else ``DeviceError``."""
    m = _SPEC.match(spec) if isinstance(spec, str) else None
    if not m or (m.group(2) is not None and m.group(1) != "cuda"):
        raise DeviceError(f"device {spec!r}: expected auto, cpu, cuda or cuda:N")
    return spec


#: Set by the trainer for each sampler it spawns (its ordinal among them on this host), in place
#: of the trainer's own LOCAL_RANK / SLURM_LOCALID: ``auto`` spreads spawned samplers over the
#: visible GPUs (slot modulo their count) instead of stacking them all on the trainer's GPU.
SPAWN_SLOT_ENV = "MIXRL_SAMPLER_SLOT"
LAUNCHER_RANK_ENV = ("LOCAL_RANK", "SLURM_LOCALID")


def spawned_env(env: Mapping[str, str], slot: int) -> dict[str, str]:
    """The environment of the ``slot``-th spawned sampler: ``env`` without the launcher's rank
    (it is the trainer's, not the sampler's), with ``MIXRL_SAMPLER_SLOT``."""
    out = {k: v for k, v in env.items() if k not in LAUNCHER_RANK_ENV}
    out[SPAWN_SLOT_ENV] = str(slot)
    return out


def local_rank(env: Mapping[str, str]) -> int | None:
    """The process's rank on its host as a launcher set it (torchrun, then SLURM), or None."""
    for key in LAUNCHER_RANK_ENV:
        value = env.get(key, "").strip()
        if value:
            if not value.isdigit():
                raise DeviceError(f"{key}={value!r} is not a non-negative integer")
            return int(value)
    return None


def spawn_slot(env: Mapping[str, str]) -> int | None:
    """``MIXRL_SAMPLER_SLOT`` (set by a trainer that spawned this sampler), or None."""
    value = env.get(SPAWN_SLOT_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise DeviceError(f"{SPAWN_SLOT_ENV}={value!r} is not a non-negative integer")
    return int(value)


def resolve_device(spec: str, *, visible: int, rank: int | None = None,
                   cuda_visible_devices: str | None = None, slot: int | None = None) -> str:
    """The torch device (``"cpu"`` or ``"cuda:N"``) that ``spec`` means for a process that sees
    ``visible`` CUDA devices and has local ``rank`` (None: not under a launcher). A sampler the
    trainer spawned has no launcher rank but a ``slot``: ``auto`` / ``cuda`` take GPU ``slot %
    visible``, so a host's spawned samplers spread over its GPUs.

    ``cuda`` without an index is the local GPU as ``auto`` picks it; ``auto`` falls back to the
    CPU when no device is visible, ``cuda`` / ``cuda:N`` raise ``DeviceError`` instead (a GPU
    asked for and absent is a configuration error, not a reason to run 100x slower).
    """
    check_spec(spec)
    seen = ("" if cuda_visible_devices is None
            else f" (CUDA_VISIBLE_DEVICES={cuda_visible_devices!r})")
    if spec == "cpu":
        return "cpu"
    if visible <= 0:
        if spec == "auto":
            return "cpu"
        raise DeviceError(f"--device {spec}: torch sees no CUDA device on this machine{seen}")
    if spec.startswith("cuda:"):
        index = int(spec.split(":")[1])
        if index >= visible:
            raise DeviceError(f"--device {spec}: only {visible} CUDA device(s) visible{seen}")
        return spec
    if rank is None and slot is not None:
        return f"cuda:{slot % visible}"
    if rank is None or visible == 1:
        return "cuda:0"
    if rank >= visible:
        raise DeviceError(f"--device {spec}: local rank {rank} but only {visible} CUDA device(s) "
                          f"visible{seen}; give each process its own device (--device cuda:N or "
                          "CUDA_VISIBLE_DEVICES)")
    return f"cuda:{rank}"


def jax_preallocation(env: Mapping[str, str]) -> float:
    """The share of each visible GPU JAX takes at start-up under ``env``: 0 when it allocates on
    demand (``XLA_PYTHON_CLIENT_PREALLOCATE=false`` or the ``platform`` allocator), else
    ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (default 0.75). ``DeviceError`` for a fraction that is
    not a number in (0, 1]."""
    if env.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").strip().lower() in ("false", "0"):
        return 0.0
    if env.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").strip().lower() == "platform":
        return 0.0
    raw = env.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "").strip()
    if not raw:
        return JAX_DEFAULT_MEM_FRACTION
    try:
        fraction = float(raw)
    except ValueError:
        fraction = float("nan")
    if not 0 < fraction <= 1:
        raise DeviceError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={raw!r} is not a fraction in (0, 1]")
    return fraction


def jax_platform(env: Mapping[str, str]) -> str:
    """The platform the trainer's JAX will run on, without importing JAX: ``JAX_PLATFORMS``'s
    first entry when set, else ``gpu`` when a JAX CUDA plugin is installed and an NVIDIA device
    node exists, else ``cpu`` (a TPU host holds no GPUs, so ``cpu`` is as good an answer there)."""
    first = env.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if first:
        return "gpu" if first in ("cuda", "gpu", "rocm") else first
    plugins = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins.xla_cuda12",
               "jax_plugins.xla_cuda13")
    try:
        has_plugin = any(importlib.util.find_spec(name) is not None for name in plugins)
    except (ImportError, ValueError):
        has_plugin = False
    return "gpu" if has_plugin and os.path.exists("/dev/nvidia0") else "cpu"


def gpu_sharing_problem(devices: Iterable[str], env: Mapping[str, str], platform: str) -> str | None:
    """Why spawned samplers on ``devices`` cannot share the trainer's GPUs, or None.

    The trainer's JAX (on ``platform``) holds every GPU its process sees -- the spawned samplers
    inherit that visibility -- and preallocates ``jax_preallocation(env)`` of each at start-up.
    A sampler on any of them (``cuda``, ``cuda:N``, and ``auto``, which resolves to one there)
    then fails out of memory or starves JAX, unless the trainer's share was lowered below the
    default. A CPU trainer holds no GPU; ``cpu`` samplers need none.
    """
    on_gpu = sorted({d for d in devices if check_spec(d) != "cpu"})
    if platform != "gpu" or not on_gpu:
        return None
    if jax_preallocation(env) < JAX_DEFAULT_MEM_FRACTION:
        return None
    return (f"spawned samplers on {', '.join(on_gpu)} would share the GPUs the JAX trainer "
            f"preallocates {JAX_DEFAULT_MEM_FRACTION:.0%} of: set XLA_PYTHON_CLIENT_MEM_FRACTION "
            "(e.g. 0.5) or XLA_PYTHON_CLIENT_PREALLOCATE=false for mixrl-train, or put the group "
            "on device: cpu")


__all__ = ["DeviceError", "JAX_DEFAULT_MEM_FRACTION", "LAUNCHER_RANK_ENV", "SPAWN_SLOT_ENV",
           "check_spec", "gpu_sharing_problem", "jax_platform", "jax_preallocation", "local_rank",
           "resolve_device", "spawn_slot", "spawned_env"]
