"""Streaming linear-log-sum-exp in plain XLA: loop over vocabulary tiles, never form [N, V].

Forward, for z = h w / T and vocabulary tiles w[:, j*B:(j+1)*B]: one [N, B] logits tile at a time
is folded into an online log-sum-exp (see ``_online``), giving lse [N] and the entropy [N].

Backward (``jax.custom_vjp``), with g = d loss / d lse and p = softmax(z) = exp(z - lse), each tile
is recomputed rather than stored:

    dZ = g[:, None] * p            (the softmax Jacobian-vector product of logsumexp)
    dh = sum_j dZ_j w_j^T / T
    dw[:, tile j] = h^T dZ_j / T

so temporary memory is one [N, B] tile whatever V is; dw is written tile by tile into the [D, V]
gradient in place. When B does not divide V the last, narrower tile is a separate static-shape
step: nothing is padded, so there is no [D, V'] copy of w or dw (V = 151,936 = 128 x 1187 for
Qwen3). Four matmuls per tile instead of the reference's three; the recompute is the price of
O(N B) memory.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from trainer_jax.kernels.linear_logsumexp import _online

Array = jax.Array

# Vocabulary tile. On the project's 2-core CPU, 2048-8192 cost about the same CPU time at
# N=2048, D=1024, V=32k (README.md here); 4096 keeps the tile at N*16 KiB with few loop steps.
DEFAULT_BLOCK_V = 4096


def _tiles(v: int, block_v: int) -> tuple[int, int, int]:
    """(tile width, number of full tiles, width of the remainder tile) for a vocabulary of v."""
    b = min(block_v, v)
    n_full, rem = divmod(v, b)
    return b, n_full, rem


def _logits(h: Array, w_tile: Array, inv_t: Array) -> Array:
    return jnp.dot(h, w_tile, preferred_element_type=jnp.float32) * inv_t


def _forward(h: Array, w: Array, inv_t: Array, block_v: int) -> tuple[Array, Array]:
    b, n_full, rem = _tiles(w.shape[1], block_v)

    def body(j: Array, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        w_tile = lax.dynamic_slice_in_dim(w, j * b, b, axis=1)
        return _online.online_update(carry, _logits(h, w_tile, inv_t))

    carry = _online.init_carry(h.shape[0])
    carry = lax.fori_loop(0, n_full, body, carry)
    if rem:
        w_last = lax.slice_in_dim(w, n_full * b, n_full * b + rem, axis=1)
        carry = _online.online_update(carry, _logits(h, w_last, inv_t))
    lse, ent = _online.finalize(carry)
    return lse[:, 0], ent[:, 0]


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _lse_streaming(h: Array, w: Array, inv_t: Array, block_v: int) -> tuple[Array, Array]:
    return _forward(h, w, inv_t, block_v)


def _fwd(h: Array, w: Array, inv_t: Array, block_v: int):
    lse, ent = _forward(h, w, inv_t, block_v)
    return (lse, ent), (h, w, inv_t, lse)


def _bwd(block_v: int, res: tuple[Array, ...], cts: tuple[Array, Array]):
    h, w, inv_t, lse = res
    g, _ = cts  # the entropy is a diagnostic: its cotangent is ignored
    g = g.astype(jnp.float32)[:, None]
    lse = lse[:, None]
    b, n_full, rem = _tiles(w.shape[1], block_v)

    def tile_grads(w_tile: Array) -> tuple[Array, Array]:
        dz = g * jnp.exp(_logits(h, w_tile, inv_t) - lse)
        # Matmul operands in the input dtype (bf16 on accelerators), fp32 accumulation.
        dz = dz.astype(w.dtype)
        dh_part = jnp.dot(dz, w_tile.T, preferred_element_type=jnp.float32)
        dw_tile = jnp.dot(h.T, dz, preferred_element_type=jnp.float32) * inv_t
        return dh_part, dw_tile.astype(w.dtype)

    def body(j: Array, carry: tuple[Array, Array]) -> tuple[Array, Array]:
        dh, dw = carry
        w_tile = lax.dynamic_slice_in_dim(w, j * b, b, axis=1)
        dh_part, dw_tile = tile_grads(w_tile)
        return dh + dh_part, lax.dynamic_update_slice_in_dim(dw, dw_tile, j * b, axis=1)

    dh = jnp.zeros(h.shape, jnp.float32)
    dw = jnp.zeros_like(w)
    dh, dw = lax.fori_loop(0, n_full, body, (dh, dw))
    if rem:
        start = n_full * b
        dh_part, dw_tile = tile_grads(lax.slice_in_dim(w, start, start + rem, axis=1))
        dh = dh + dh_part
        dw = lax.dynamic_update_slice_in_dim(dw, dw_tile, start, axis=1)
    dh = (dh * inv_t).astype(h.dtype)
    return dh, dw, jnp.zeros_like(inv_t)


_lse_streaming.defvjp(_fwd, _bwd)


def linear_logsumexp_xla(
    h: Array, w: Array, temperature: Array, *, block_v: int = DEFAULT_BLOCK_V
) -> tuple[Array, Array]:
    """(lse [N], entropy [N]) float32 for z = h w / temperature, streamed over vocab tiles.

    ``block_v`` is the vocabulary tile width (temporary memory ~ N * block_v * 4 bytes per
    live tile). Gradients flow to ``h`` and ``w`` through lse only.
    """
    if block_v < 1:
        raise ValueError(f"block_v must be a positive int, got {block_v}")
    inv_t = lax.stop_gradient(1.0 / jnp.asarray(temperature, jnp.float32))
    lse, ent = _lse_streaming(h, w, inv_t, int(block_v))
    return lse, lax.stop_gradient(ent)
