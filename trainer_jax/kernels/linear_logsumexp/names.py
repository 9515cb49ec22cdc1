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

# What ``auto`` picks per JAX platform. ``pallas`` goes in here for a platform only once
# ``scripts/device_check.sh`` has compared it with ``reference`` on that hardware; none has been
# checked yet, so every platform gets the portable streaming ``xla`` kernel (docs/scale_out.md).
AUTO_IMPL: dict[str, str] = {"cpu": "xla", "gpu": "xla", "tpu": "xla"}


def resolve_impl(impl: str, platform: str | None = None) -> str:
    """``impl`` itself, or for ``auto`` the implementation chosen for ``platform`` (default: JAX's)."""
    if impl != AUTO:
        return impl
    if platform is None:
        import jax

        platform = jax.default_backend()
    return AUTO_IMPL.get(platform, "xla")
