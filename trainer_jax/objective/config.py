"""The objective's config lives in the JAX-free schema (``trainer_jax.config.learning``)."""

from __future__ import annotations

from trainer_jax.config.learning import ObjectiveConfig
from trainer_jax.kernels.linear_logsumexp.names import IMPL_NAMES

# Defined once, in the kernel package; re-exported under the objective's established name.
KERNEL_IMPLS = IMPL_NAMES

__all__ = ["KERNEL_IMPLS", "ObjectiveConfig"]
