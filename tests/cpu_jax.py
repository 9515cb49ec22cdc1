"""The environment of a JAX process the tests start on this CPU with ``devices`` simulated devices.

It keeps the session's XLA flags (tests/conftest.py: no LLVM optimisation passes, about half the
compile time) and its persistent compilation cache: a child given a bare ``XLA_FLAGS`` compiled
at full optimisation and took twice as long. Only the device count is replaced.
"""

from __future__ import annotations

import os

_COUNT = "--xla_force_host_platform_device_count"


def cpu_jax_env(devices: int = 1, base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``base`` (default ``os.environ``) with ``JAX_PLATFORMS=cpu``, quiet XLA logging, ``devices``
    host-platform devices and the other XLA flags it already had; ``extra`` last."""
    env = dict(os.environ if base is None else base)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_COUNT)]
    return {**env, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "2",
            "XLA_FLAGS": " ".join([*flags, f"{_COUNT}={devices}"]), **extra}
