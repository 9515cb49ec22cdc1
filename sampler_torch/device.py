"""Which torch device a sampler computes on: ``mixrl-sample --device`` and ``groups[].device``.

The spec rules (``auto`` = the local GPU under a launcher, else the CPU; ``cuda:N`` indexes the
devices ``CUDA_VISIBLE_DEVICES`` leaves visible) are torch-free pure functions in
``mixrl_wire.devices``, shared with the trainer's config checks; ``local_device`` feeds them
from torch and the environment, ``describe`` says what a registration reports.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from mixrl_wire.devices import DeviceError, check_spec, local_rank, resolve_device, spawn_slot


def local_device(spec: str, env: Mapping[str, str] | None = None) -> str:
    """``resolve_device`` for this process: torch's visible device count, the launcher's rank or
    the slot a spawning trainer gave (``cpu`` without importing torch: the checks after it answer
    sooner)."""
    env = os.environ if env is None else env
    if check_spec(spec) == "cpu":
        return "cpu"
    import torch

    visible = torch.cuda.device_count() if spec != "cpu" and torch.cuda.is_available() else 0
    return resolve_device(spec, visible=visible, rank=local_rank(env),
                          cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"), slot=spawn_slot(env))


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
    return {"type": device.type, "name": cpu_name() or platform.processor() or platform.machine()
            or device.type}


def cpu_name(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The processor's model as Linux names it (``model name`` in ``/proc/cpuinfo``, e.g. ``AMD
    EPYC 9654 96-Core Processor``; ARM kernels may say ``Model`` or only ``CPU part``); "" when
    the file is absent or names none. ``platform.processor()`` is only the architecture
    (``x86_64``) on Linux, which says nothing about the machine's speed."""
    try:
        with open(cpuinfo, errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() in ("model name", "Model", "Hardware") and value.strip():
                    return " ".join(value.split())
    except OSError:
        pass
    return ""


__all__ = ["DeviceError", "check_spec", "cpu_name", "describe", "local_device", "local_rank",
           "resolve_device"]
