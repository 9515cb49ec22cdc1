"""Online (streaming) log-sum-exp with an entropy accumulator, shared by the tiled kernels.

Over vocabulary tiles we keep, per token, three running numbers relative to the running max m:

    s = sum_v exp(z_v - m)
    a = sum_v exp(z_v - m) (z_v - m)

Moving to a new max m' rescales both: s <- s e^(m - m'), a <- e^(m - m') (a + (m - m') s).
At the end lse = m + log s, sum_v p_v z_v = m + a / s, so the entropy
H = lse - sum_v p_v z_v = log s - a / s. Keeping ``a`` relative to m avoids the cancellation of
computing lse - sum p z from two large numbers.

Carries have a trailing unit axis ([rows, 1]) so the same code runs inside TPU kernels, where
1-D vectors are awkward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

# A finite stand-in for -inf: masked logits and the initial running max. Finite so that the
# products (m - m') * s and exp(z - m') * (z - m') are 0 rather than nan when s or exp is 0.
NEG = -1e30


def init_carry(rows: int) -> tuple[Array, Array, Array]:
    """Empty accumulators (m, s, a) for ``rows`` tokens, each [rows, 1] float32."""
    shape = (rows, 1)
    return (
        jnp.full(shape, NEG, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros(shape, jnp.float32),
    )


def online_update(carry: tuple[Array, Array, Array], z: Array) -> tuple[Array, Array, Array]:
    """Fold a tile of fp32 logits ``z`` [rows, tile] (masked entries = NEG) into the carry."""
    m, s, a = carry
    m_new = jnp.maximum(m, jnp.max(z, axis=-1, keepdims=True))
    delta = m - m_new
    scale = jnp.exp(delta)
    zc = z - m_new
    e = jnp.exp(zc)
    s_new = scale * s + jnp.sum(e, axis=-1, keepdims=True)
    a_new = scale * (a + delta * s) + jnp.sum(e * zc, axis=-1, keepdims=True)
    return m_new, s_new, a_new


def finalize(carry: tuple[Array, Array, Array]) -> tuple[Array, Array]:
    """(lse, entropy), each [rows, 1], from the accumulators."""
    m, s, a = carry
    log_s = jnp.log(s)
    return m + log_s, log_s - a / s
