"""Vocabulary-parallel linear-log-sum-exp: each ``tensor`` shard holds a slice of the LM head.

With ``w [D, V]`` split over the vocabulary into tiles ``w_i`` (one per shard) and z = h w / T,
every shard runs the fused kernel on its own tile, giving ``lse_i`` and ``ent_i``, and

    lse      = logsumexp_i lse_i                         (a max and a sum across the axis)
    sum p z  = sum_i exp(lse_i - lse) * (lse_i - ent_i)  (since ent_i = lse_i - sum_{v in i} p_i z)
    entropy  = lse - sum p z

Head logits ``z[n, ids[n, m]]`` are gathered by the shard that owns each id (zero elsewhere)
and summed across the axis. Autodiff goes through the collectives: each shard's kernel backward
receives ``g * exp(lse_i - lse)`` and writes only its own columns of dW. No device ever holds
more than ``V / tensor`` columns of the head or its gradient, nor any ``[N, V]`` logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from trainer_jax.objective.logits import KernelOptions, lse_and_logits_at
from trainer_jax.parallel import hooks
from trainer_jax.parallel.context import ParallelContext, linear_axis_index

Array = jax.Array
sg = jax.lax.stop_gradient


def combine_lse(lse_i: Array, ent_i: Array, axes: Sequence[str]) -> tuple[Array, Array]:
    """Inside ``shard_map``: the global (lse, entropy) from each vocabulary tile's own."""
    axes = tuple(axes)
    m = jax.lax.pmax(sg(lse_i), axes)  # a stability shift only: no gradient needed through it
    lse = m + jnp.log(jax.lax.psum(jnp.exp(lse_i - m), axes))
    weight = sg(jnp.exp(lse_i - lse))
    mean_z = jax.lax.psum(weight * sg(lse_i - ent_i), axes)
    return lse, sg(lse - mean_z)


def _specs(ctx: ParallelContext, n: int, v: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    tokens = ctx.rules.mesh_axes("tokens", n, ctx.mesh)  # the batch axes, and context if any
    vocab = ctx.rules.mesh_axes("vocab", v, ctx.mesh)
    return tokens, vocab


def vocab_parallel_lse_and_logits_at(ctx: ParallelContext, h: Array, w: Array, ids: Array,
                                     temperature: float, impl: str, block: int,
                                     options: KernelOptions = ()) -> tuple[Array, Array, Array]:
    """``objective.logits.lse_and_logits_at`` with ``w`` split over the vocabulary axis.

    Tokens stay split over the batch axes. When no mesh axis splits ``V`` (tensor size 1, or it
    does not divide ``V``) every device runs the whole head on its own tokens: the head is
    gathered once at the map's boundary instead of by the partitioner inside the kernel's loop.
    """
    tokens, vocab = _specs(ctx, h.shape[0], w.shape[1])
    tok = tokens or None

    def local(h_l: Array, w_l: Array, ids_l: Array) -> tuple[Array, Array, Array]:
        with hooks.use(None):  # plain per-shard code below: no nested mesh annotations
            block_l = max(1, min(block, h_l.shape[0]))
            if not vocab:  # the head whole on every device: data-parallel over the tokens
                return lse_and_logits_at(h_l, w_l, ids_l, temperature, impl, block_l, options)
            v_local = w_l.shape[1]
            local_ids = ids_l - linear_axis_index(vocab, ctx.mesh) * v_local
            mine = (local_ids >= 0) & (local_ids < v_local)
            lse_i, ent_i, z_i = lse_and_logits_at(h_l, w_l, jnp.where(mine, local_ids, 0), temperature,
                                                  impl, block_l, options)
            lse, ent = combine_lse(lse_i, ent_i, vocab)
            return lse, ent, jax.lax.psum(jnp.where(mine, z_i, 0.0), vocab)

    return jax.shard_map(local, mesh=ctx.mesh, in_specs=(P(tok, None), P(None, vocab or None), P(tok, None)),
                         out_specs=(P(tok), P(tok), P(tok, None)), check_vma=False)(h, w, ids)


def vocab_parallel_linear_logsumexp(ctx: ParallelContext, h: Array, w: Array, *,
                                    temperature: float = 1.0, impl: str = "xla",
                                    **options) -> tuple[Array, Array]:
    """``kernels.linear_logsumexp`` (lse, entropy) with ``w [D, V]`` split over the vocabulary."""
    from trainer_jax.kernels import linear_logsumexp

    tokens, vocab = _specs(ctx, h.shape[0], w.shape[1])
    if not vocab:
        return linear_logsumexp(h, w, temperature=temperature, impl=impl, **options)
    tok = tokens or None

    def local(h_l: Array, w_l: Array) -> tuple[Array, Array]:
        with hooks.use(None):
            lse_i, ent_i = linear_logsumexp(h_l, w_l, temperature=temperature, impl=impl, **options)
            return combine_lse(lse_i, ent_i, vocab)

    return jax.shard_map(local, mesh=ctx.mesh, in_specs=(P(tok, None), P(None, vocab)),
                         out_specs=(P(tok), P(tok)), check_vma=False)(h, w)
