"""Which torch device a sampler computes on: ``mixrl-sample --device`` and ``groups[].device``.

``auto`` is the local GPU when torch sees one, else the CPU. "Local" follows the launcher: under
torchrun (``LOCAL_RANK``) or SLURM (``SLURM_LOCALID``) process ``r`` of a host takes the ``r``-th
*visible* device, so samplers started side by side spread over the GPUs instead of piling onto
the first one; a process that sees exactly one device (Ray, SLURM ``--gpus-per-task`` and any
other launcher that sets ``CUDA_VISIBLE_DEVICES`` per process) takes that one whatever its rank.
torch numbers only the devices ``CUDA_VISIBLE_DEVICES`` leaves visible, so ``cuda:N`` and the
rank are indices into that list, never physical ids.

``resolve_device`` is a pure function of the spec and of what the process sees (visible count,
local rank, ``CUDA_VISIBLE_DEVICES``), so every rule here is tested without a GPU;
``local_device`` feeds it from torch and the environment.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

_SPEC = re.compile(r"^(auto|cpu|cuda)(?::(\d+))?$")


class DeviceError(ValueError):
    """A device spec that is malformed or names a device this process cannot see."""


def check_spec(spec: str) -> str:
    """``spec`` if it is ``auto``, ``cpu``, ``cuda`` or ``cuda:N``; else ``DeviceError``."""
    m = _SPEC.match(spec)
    if not m or (m.group(2) is not None and m.group(1) != "cuda"):
        raise DeviceError(f"--device {spec!r}: expected auto, cpu, cuda or cuda:N")
    return spec


def local_rank(env: Mapping[str, str]) -> int | None:
    """The process's rank on its host as a launcher set it (torchrun, then SLURM), or None."""
    for key in ("LOCAL_RANK", "SLURM_LOCALID"):
        value = env.get(key, "").strip()
        if value:
            if not value.isdigit():
                raise DeviceError(f"{key}={value!r} is not a non-negative integer")
            return int(value)
    return None


def resolve_device(spec: str, *, visible: int, rank: int | None = None,
                   cuda_visible_devices: str | None = None) -> str:
    """The torch device (``"cpu"`` or ``"cuda:N"``) that ``spec`` means for a process that sees
    ``visible`` CUDA devices and has local ``rank`` (None: not under a launcher).

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
    if rank is None or visible == 1:
        return "cuda:0"
    if rank >= visible:
        raise DeviceError(f"--device {spec}: local rank {rank} but only {visible} CUDA device(s) "
                          f"visible{seen}; give each process its own device (--device cuda:N or "
                          "CUDA_VISIBLE_DEVICES)")
    return f"cuda:{rank}"


def local_device(spec: str, env: Mapping[str, str] | None = None) -> str:
    """``resolve_device`` for this process: torch's visible device count, the launcher's rank."""
    import torch

    env = os.environ if env is None else env
    check_spec(spec)
    visible = torch.cuda.device_count() if spec != "cpu" and torch.cuda.is_available() else 0
    return resolve_device(spec, visible=visible, rank=local_rank(env),
                          cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"))


def describe(device) -> dict[str, str]:
    """``{"type": "cuda", "name": "NVIDIA H200", "index": "0", "capability": "9.0"}`` for a
    CUDA device, ``{"type": "cpu", "name": <processor>}`` for the CPU: what a registration says."""
    import platform

    import torch

    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return {"type": "cuda", "name": torch.cuda.get_device_name(index), "index": str(index),
                "capability": f"{major}.{minor}"}
    return {"type": device.type, "name": platform.processor() or platform.machine() or device.type}


__all__ = ["DeviceError", "check_spec", "describe", "local_device", "local_rank", "resolve_device"]
