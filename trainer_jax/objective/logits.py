"""The only trainer-logit quantities the objective needs, without ever forming [N, V] logits.

``lse_and_logits_at(h, w, ids, ...)`` returns, for z = h w / tau,
    lse [N] = logsumexp_v z[n, v]          (the fused linear-log-sum-exp kernel)
    entropy [N]                            (kernel diagnostic, no gradient)
    z_ids [N, M] = z[n, ids[n, m]]          (a gather: h[n] . w[:, ids[n, m]] / tau)

Why one custom_vjp around both: a plain gather's transpose is a scatter-add into a fresh zero
[D, V] buffer, added afterwards to the kernel's own dW -- one extra full-size lm_head gradient in
temporary memory (0.6 GB f32 for Qwen3), which is as large as everything else the streaming kernel
needs. Here the backward scatters the head contributions straight into the kernel's dW, in place,
a block of tokens at a time, so the only [D, V] array is the gradient itself.

The gather is blocked over tokens so that the gathered columns w[:, ids] ([D, B, M] per block)
stay ~4 MiB whatever N and M are; the backward updates dh and dW in place in its loop carry.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array

# Elements of gathered lm_head columns per token block (1 Mi f32 = 4 MiB): small next to the
# kernel's vocabulary tile, and the per-block loop overhead is negligible next to the matmuls.
_GATHER_BLOCK_ELEMS = 1024 * 1024


KernelOptions = tuple[tuple[str, Any], ...]


def _kernel(
    h: Array, w: Array, temperature: float, impl: str, options: KernelOptions = ()
) -> tuple[Array, Array]:
    # Imported lazily: the kernel package is a sibling that the objective only calls through
    # its public API.
    from trainer_jax.kernels import linear_logsumexp

    return linear_logsumexp(h, w, temperature=temperature, impl=impl, **dict(options))


def default_block_size(n: int, d: int, m: int) -> int:
    """Tokens per gather block so that a block's gathered columns hold ~4 MiB (f32)."""
    return max(1, min(n, _GATHER_BLOCK_ELEMS // max(1, d * m)))


def _gather_block(h_b: Array, w: Array, ids_b: Array, inv_tau: float) -> Array:
    """z[b, m] = h_b[b] . w[:, ids_b[b, m]] / tau for one block ([B, D], [B, M] -> [B, M] f32)."""
    cols = jnp.take(w, ids_b, axis=1, mode="clip")  # [D, B, M]
    z = jnp.einsum("bd,dbm->bm", h_b, cols, preferred_element_type=jnp.float32)
    return z * inv_tau


def _for_blocks(n: int, block: int, step: Callable[[Any, Array, int], Any], carry: Any) -> Any:
    """Run ``step(carry, start, size)`` over token blocks [start, start + size) covering [0, n).

    Full blocks run in a fori_loop (dynamic starts), the remainder once with its own static size:
    no padding and no sliced copies of h (a sliced/reshaped h would be an [N, D] temporary).
    """
    nb, rem = divmod(n, block)
    if nb:
        carry = lax.fori_loop(0, nb, lambda i, c: step(c, i * block, block), carry)
    if rem:
        carry = step(carry, jnp.int32(nb * block), rem)
    return carry


def _gather_logits(h: Array, w: Array, ids: Array, inv_tau: float, block: int) -> Array:
    def step(z: Array, start: Array, size: int) -> Array:
        h_b = lax.dynamic_slice_in_dim(h, start, size)
        ids_b = lax.dynamic_slice_in_dim(ids, start, size)
        return lax.dynamic_update_slice_in_dim(z, _gather_block(h_b, w, ids_b, inv_tau), start, 0)

    return _for_blocks(h.shape[0], block, step, jnp.zeros(ids.shape, jnp.float32))


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def lse_and_logits_at(
    h: Array,
    w: Array,
    ids: Array,
    temperature: float,
    impl: str,
    block: int,
    options: KernelOptions = (),
) -> tuple[Array, Array, Array]:
    """(lse [N], entropy [N], z[n, ids[n, m]] [N, M]) for z = h w / temperature.

    ``ids`` must already be in [0, V) (callers replace padding by 0 and mask the result).
    Differentiable in h and w through lse and z_ids; entropy carries no gradient.
    """
    lse, ent = _kernel(h, w, temperature, impl, options)
    return lse, ent, _gather_logits(h, w, ids, 1.0 / temperature, block)


def _fwd(
    h: Array,
    w: Array,
    ids: Array,
    temperature: float,
    impl: str,
    block: int,
    options: KernelOptions,
) -> tuple[tuple[Array, Array, Array], tuple[Any, ...]]:
    (lse, ent), pullback = jax.vjp(lambda hh, ww: _kernel(hh, ww, temperature, impl, options), h, w)
    z = _gather_logits(h, w, ids, 1.0 / temperature, block)
    return (lse, ent, z), (pullback, h, w, ids)


def _bwd(
    temperature: float,
    impl: str,
    block: int,
    options: KernelOptions,
    res: tuple[Any, ...],
    cts: tuple[Array, ...],
) -> tuple[Array, Array, None]:
    pullback, h, w, ids = res
    g_lse, g_ent, g_z = cts
    # The kernel's entropy is stop-gradient; feed it an explicit zero cotangent.
    dh, dw = pullback((g_lse, jnp.zeros_like(g_ent)))
    inv_tau = 1.0 / temperature
    n = h.shape[0]

    def step(carry: tuple[Array, Array], start: Array, size: int) -> tuple[Array, Array]:
        # Both gradients are updated in place in the loop carry: no [N, D] or [D, V] temporaries
        # beyond the kernel's own gradients.
        dh_acc, dw_acc = carry
        h_b = lax.dynamic_slice_in_dim(h, start, size)
        ids_b = lax.dynamic_slice_in_dim(ids, start, size)
        g_b = lax.dynamic_slice_in_dim(g_z, start, size).astype(jnp.float32) * inv_tau
        cols = jnp.take(w, ids_b, axis=1, mode="clip")  # [D, B, M]
        dh_b = jnp.einsum("bm,dbm->bd", g_b, cols, preferred_element_type=jnp.float32)
        dh_b = dh_b + lax.dynamic_slice_in_dim(dh_acc, start, size).astype(jnp.float32)
        dh_acc = lax.dynamic_update_slice_in_dim(dh_acc, dh_b.astype(dh_acc.dtype), start, 0)
        upd = jnp.einsum("bd,bm->dbm", h_b.astype(jnp.float32), g_b)  # [D, B, M]
        # Scatter-add into the running dW (the kernel's dW to start with); duplicate ids within
        # a block accumulate, as they must.
        dw_acc = dw_acc.at[:, ids_b].add(upd.astype(dw_acc.dtype), mode="promise_in_bounds")
        return dh_acc, dw_acc

    dh, dw = _for_blocks(n, block, step, (dh, dw))
    return dh.astype(h.dtype), dw.astype(w.dtype), None


lse_and_logits_at.defvjp(_fwd, _bwd)
