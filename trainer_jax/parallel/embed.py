"""Sharded embedding lookup whose backward moves the token rows to the table's layout first.

The table ``[V, D]`` is split with ``D`` over ``embed``'s mesh axes (``fsdp``, or ``fsdp`` and
``expert`` with the ``embed`` override), the activations with the batch over ``batch``'s
(``data``, ``fsdp``, ``expert``). The table's gradient is a scatter-add of the output's cotangent
rows; left to itself, the SPMD partitioner finds no way from batch-split rows to ``D``-split ones
on meshes where both use several axes ((2 data x 2 fsdp x 2 expert): "Involuntary full
rematerialization"), and all-gathers every token row of the step onto every device.

Here the backward first reshards the cotangent rows to the batch over the batch axes the table
does not use and ``D`` over the ones it does (an all-to-all over those axes), then scatter-adds
into the table's own ``D`` slice; the sum over the remaining batch axes is an all-reduce of a
``[V, D / embed]`` slice, the data-parallel gradient reduction every other weight gets too.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trainer_jax.parallel.context import ParallelContext
from trainer_jax.parallel.rules import spec_axes


def embed_lookup(ctx: ParallelContext, table: jax.Array, ids: jax.Array) -> jax.Array:
    """``table[ids]`` (``[B, T] -> [B, T, D]``) with the resharding backward (module docstring)."""
    mesh, rules = ctx.mesh, ctx.rules
    table_spec = rules.param_spec("embed_tokens/embedding", table.shape, mesh)
    d_axes = spec_axes(table_spec, 1)
    rows_spec = rules.spec(("batch", "seq", None), (*ids.shape, table.shape[1]), mesh)
    batch_axes = tuple(a for a in spec_axes(rows_spec, 0) if a not in d_axes)
    seq_axes = tuple(a for a in spec_axes(rows_spec, 1) if a not in d_axes)  # context, unless D uses it
    cotangent = P(batch_axes or None, seq_axes or None, d_axes or None)
    shardings = (NamedSharding(mesh, cotangent), NamedSharding(mesh, table_spec))
    return _lookup(table, ids, (table.shape, table.dtype), shardings)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _lookup(table: jax.Array, ids: jax.Array, table_type: tuple[tuple[int, int], jnp.dtype],
            shardings: tuple[NamedSharding, NamedSharding]) -> jax.Array:
    return jnp.take(table, ids, axis=0)


def _lookup_fwd(table, ids, table_type, shardings):
    return _lookup(table, ids, table_type, shardings), ids


def _lookup_bwd(table_type, shardings, ids, g):
    (shape, dtype), (cotangent, table_sharding) = table_type, shardings
    g = jax.lax.with_sharding_constraint(g, cotangent)
    grad = jnp.zeros(shape, dtype).at[ids].add(g.astype(dtype))
    return jax.lax.with_sharding_constraint(grad, table_sharding), None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)
