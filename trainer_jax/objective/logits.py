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
stay ~32 MiB whatever N and M are.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array

# Elements of gathered lm_head columns per token block (8 Mi f32 = 32 MiB).
_GATHER_BLOCK_ELEMS = 8 * 1024 * 1024


def _kernel(h: Array, w: Array, temperature: float, impl: str) -> tuple[Array, Array]:
    # Imported lazily: the kernel package is a sibling that the objective only calls through
    # its public API.
    from trainer_jax.kernels import linear_logsumexp

    return linear_logsumexp(h, w, temperature=temperature, impl=impl)


def default_block_size(n: int, d: int, m: int) -> int:
    """Tokens per gather block so that a block's gathered columns hold ~32 MiB."""
    return max(1, min(n, _GATHER_BLOCK_ELEMS // max(1, d * m)))


def _gather_block(h_b: Array, w: Array, ids_b: Array, inv_tau: float) -> Array:
    """z[b, m] = h_b[b] . w[:, ids_b[b, m]] / tau for one block ([B, D], [B, M] -> [B, M] f32)."""
    cols = jnp.take(w, ids_b, axis=1, mode="clip")  # [D, B, M]
    z = jnp.einsum("bd,dbm->bm", h_b, cols, preferred_element_type=jnp.float32)
    return z * inv_tau


def _blocked_scan(
    body: Callable[[Any, Any], tuple[Any, Any]], carry: Any, xs: Any, block: int
) -> tuple[Any, Any]:
    """lax.scan of ``body`` over leading-axis blocks of ``xs`` (remainder block run once after).

    ``body(carry, xs_block) -> (carry, ys_block)``; the ys blocks are concatenated back to [N, ...].
    Avoids padding xs (which would copy h) when N is not a multiple of ``block``.
    """
    n = jax.tree.leaves(xs)[0].shape[0]
    nb, rem = divmod(n, block)
    ys_parts = []
    if nb:
        main = jax.tree.map(lambda x: x[: nb * block].reshape(nb, block, *x.shape[1:]), xs)
        carry, ys = jax.lax.scan(body, carry, main)
        ys_parts.append(jax.tree.map(lambda y: y.reshape(nb * block, *y.shape[2:]), ys))
    if rem:
        carry, ys = body(carry, jax.tree.map(lambda x: x[nb * block :], xs))
        ys_parts.append(ys)
    if len(ys_parts) == 1:
        return carry, ys_parts[0]
    return carry, jax.tree.map(lambda *p: jnp.concatenate(p, axis=0), *ys_parts)


def _gather_logits(h: Array, w: Array, ids: Array, inv_tau: float, block: int) -> Array:
    def body(carry: None, xb: tuple[Array, Array]) -> tuple[None, Array]:
        return None, _gather_block(xb[0], w, xb[1], inv_tau)

    return _blocked_scan(body, None, (h, ids), block)[1]


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def lse_and_logits_at(
    h: Array, w: Array, ids: Array, temperature: float, impl: str, block: int
) -> tuple[Array, Array, Array]:
    """(lse [N], entropy [N], z[n, ids[n, m]] [N, M]) for z = h w / temperature.

    ``ids`` must already be in [0, V) (callers replace padding by 0 and mask the result).
    Differentiable in h and w through lse and z_ids; entropy carries no gradient.
    """
    lse, ent = _kernel(h, w, temperature, impl)
    return lse, ent, _gather_logits(h, w, ids, 1.0 / temperature, block)


def _fwd(
    h: Array, w: Array, ids: Array, temperature: float, impl: str, block: int
) -> tuple[tuple[Array, Array, Array], tuple[Any, ...]]:
    (lse, ent), pullback = jax.vjp(lambda hh, ww: _kernel(hh, ww, temperature, impl), h, w)
    z = _gather_logits(h, w, ids, 1.0 / temperature, block)
    return (lse, ent, z), (pullback, h, w, ids)


def _bwd(
    temperature: float, impl: str, block: int, res: tuple[Any, ...], cts: tuple[Array, ...]
) -> tuple[Array, Array, None]:
    pullback, h, w, ids = res
    g_lse, g_ent, g_z = cts
    # The kernel's entropy is stop-gradient; feed it an explicit zero cotangent.
    dh, dw = pullback((g_lse, jnp.zeros_like(g_ent)))
    inv_tau = 1.0 / temperature

    def body(dw_acc: Array, xb: tuple[Array, Array, Array]) -> tuple[Array, Array]:
        h_b, ids_b, g_b = xb
        g_b = g_b.astype(jnp.float32) * inv_tau
        cols = jnp.take(w, ids_b, axis=1, mode="clip")  # [D, B, M]
        dh_b = jnp.einsum("bm,dbm->bd", g_b, cols, preferred_element_type=jnp.float32)
        upd = jnp.einsum("bd,bm->dbm", h_b.astype(jnp.float32), g_b)  # [D, B, M]
        # In-place scatter-add into the running dW (the kernel's dW to start with); duplicate
        # ids within a block accumulate, as they must.
        dw_acc = dw_acc.at[:, ids_b].add(upd.astype(dw_acc.dtype), mode="promise_in_bounds")
        return dw_acc, dh_b

    dw, dh_head = _blocked_scan(body, dw, (h, ids, g_z), block)
    dh = (dh.astype(jnp.float32) + dh_head).astype(h.dtype)
    return dh, dw.astype(w.dtype), None


lse_and_logits_at.defvjp(_fwd, _bwd)
