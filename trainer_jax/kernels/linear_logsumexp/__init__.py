"""Fused linear-log-sum-exp: lse and entropy of softmax(h w / T) without [N, V] logits.

Implementations (``IMPL_NAMES``): ``reference`` (oracle), ``xla`` (streaming + custom_vjp),
``pallas`` (tile sizes as ``BlockSizes``).
"""

from trainer_jax.kernels.linear_logsumexp.api import IMPLS, linear_logsumexp
from trainer_jax.kernels.linear_logsumexp.names import IMPL_NAMES, ImplName
from trainer_jax.kernels.linear_logsumexp.pallas_common import BlockSizes

__all__ = ["IMPLS", "IMPL_NAMES", "BlockSizes", "ImplName", "linear_logsumexp"]
