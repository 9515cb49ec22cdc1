"""Fused linear-log-sum-exp: lse and entropy of softmax(h w / T) without [N, V] logits.

Implementations: ``reference`` (oracle), ``xla`` (streaming + custom_vjp), ``pallas``.
"""

from trainer_jax.kernels.linear_logsumexp.api import IMPLS, linear_logsumexp

__all__ = ["IMPLS", "linear_logsumexp"]
