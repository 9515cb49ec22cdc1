"""The implementation names, defined once for the kernel API, configs and benchmarks.

``ImplName`` is the single place a name is spelled: ``IMPL_NAMES`` is read back from it, so a
pydantic field typed ``ImplName`` and a check ``impl in IMPL_NAMES`` can never disagree. Adding
an implementation is one line here plus its entry in ``api.IMPLS`` (checked at import time).

``auto`` (the config default) is not an implementation but a choice per platform, made by
``resolve_impl`` when a step is traced.
"""

from __future__ import annotations

from typing import Literal, get_args

ImplName = Literal["reference", "xla", "pallas"]

IMPL_NAMES: tuple[str, ...] = get_args(ImplName)

AUTO = "auto"
#: what ``ObjectiveConfig.impl`` accepts
IMPL_CHOICES: tuple[str, ...] = (AUTO, *IMPL_NAMES)

# What ``auto`` picks per JAX platform when no fused kernel has passed ``scripts/device_check.sh``
# there: the portable streaming ``xla`` kernel. ``pallas`` is picked only for a platform, device
# kind and JAX minor version the check recorded a pass for (``trainer_jax/kernels/checked.py``).
# (``checked.FALLBACK`` is the one that runs; this table documents it per platform.)
AUTO_IMPL: dict[str, str] = {"cpu": "xla", "gpu": "xla", "tpu": "xla"}


def resolve_impl(impl: str, platform: str | None = None) -> str:
    """``impl`` itself, or for ``auto`` the implementation chosen for ``platform`` (default: JAX's):
    ``pallas`` where the device check passed it on this device kind and JAX minor, else ``xla``."""
    if impl != AUTO:
        return impl
    from trainer_jax.kernels import checked

    return checked.choose("linear_logsumexp", checked.here(platform))[0]
