"""Fused kernels for the trainer."""

from trainer_jax.kernels.linear_logsumexp import IMPLS as LINEAR_LOGSUMEXP_IMPLS
from trainer_jax.kernels.linear_logsumexp import linear_logsumexp

__all__ = ["LINEAR_LOGSUMEXP_IMPLS", "linear_logsumexp"]
