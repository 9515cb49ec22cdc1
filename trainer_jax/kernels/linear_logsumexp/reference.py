"""Reference linear-log-sum-exp: plain jnp over the full [N, V] logits (the oracle).

For z = h w / T (fp32 accumulation):

    lse[n]     = log sum_v exp(z[n, v])
    entropy[n] = -sum_v p[n, v] log p[n, v],   p = softmax(z[n])  (= lse - sum_v p z)

Memory is O(N V); use it to check the streaming implementations, not to train.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def linear_logsumexp_reference(h: Array, w: Array, temperature: Array) -> tuple[Array, Array]:
    """(lse [N], entropy [N]) in float32 from the materialised logits.

    Differentiable in ``h`` and ``w`` through ``lse`` by ordinary autodiff; ``temperature`` and
    the entropy are stop-gradient, matching the streaming implementations.
    """
    inv_t = jax.lax.stop_gradient(1.0 / jnp.asarray(temperature, jnp.float32))
    z = jnp.dot(h, w, preferred_element_type=jnp.float32) * inv_t
    lse = jax.nn.logsumexp(z, axis=-1)
    logp = z - lse[:, None]
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return lse, jax.lax.stop_gradient(entropy)
