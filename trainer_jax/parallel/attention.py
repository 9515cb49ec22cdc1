"""Attention on a mesh with ``shard_map``: every device runs the kernel on its own rows and heads.

The fused kernels (Pallas flash on GPU, splash on TPU) are custom calls the SPMD partitioner
cannot split: handed globally sharded ``q, k, v`` it would gather every row and head onto every
device and run the whole attention there. Attention needs no communication at all under the
model's layout (rows split over the batch axes, heads over ``tensor``, the sequence whole), so the
map hands each device its block and runs the single-device ``attention`` on it, whatever the
implementation; the blocked XLA form gets per-device block bounds that way too.

Heads: query heads split over ``heads``' axes (a contiguous range per device), K/V heads over
``kv_heads``' axes. When the K/V heads are split too, each device holds exactly the K/V heads of
its query heads (``H / K`` query heads per K/V head on both sides). When there are fewer K/V heads
than shards (K/V whole on every device, as the projection rules keep them), each device takes the
one K/V head its query heads share; that needs ``H / K`` to be a multiple of the query heads per
device. Any other split leaves the heads whole inside the map (correct; the partitioner gathers).
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from trainer_jax.models.attention import attention
from trainer_jax.parallel import hooks
from trainer_jax.parallel.context import ParallelContext, linear_axis_index
from trainer_jax.parallel.rules import spec_axes

Array = jax.Array


def head_layout(ctx: ParallelContext, q_shape: tuple[int, ...], kv_shape: tuple[int, ...]
                ) -> tuple[P, P, tuple[str, ...]]:
    """PartitionSpecs of ``q`` and ``k``/``v`` inside the map, and the axes K/V heads are *picked*
    along (non-empty only when K/V stay whole while query heads are split; module docstring)."""
    mesh, rules = ctx.mesh, ctx.rules
    q_spec = rules.spec(("batch", "seq", "heads", None), q_shape, mesh)
    kv_spec = rules.spec(("batch", "seq", "kv_heads", None), kv_shape, mesh)
    batch, q_heads, kv_heads = spec_axes(q_spec, 0), spec_axes(q_spec, 2), spec_axes(kv_spec, 2)
    batch_entry = batch or None
    group = q_shape[2] // kv_shape[2]
    per_device = q_shape[2] // math.prod(mesh.shape[axis] for axis in q_heads)
    if q_heads == kv_heads or not q_heads:
        pick: tuple[str, ...] = ()
    elif not kv_heads and group % per_device == 0:
        pick = q_heads
    else:  # an uneven split: keep every head on every device
        q_heads, kv_heads, pick = (), (), ()
    q_inner = P(batch_entry, None, q_heads or None)
    kv_inner = P(batch_entry, None, kv_heads or None)
    return q_inner, kv_inner, pick


def attention_forward(ctx: ParallelContext, q: Array, k: Array, v: Array, segment_ids: Array, *,
                      impl: str | None = None, **options: Any) -> Array:
    """``attention(q, k, v, segment_ids, impl=impl)`` with rows and heads split (module docstring)."""
    mesh = ctx.mesh
    q_spec, kv_spec, pick = head_layout(ctx, q.shape, k.shape)
    seg_spec = P(q_spec[0])
    group = q.shape[2] // k.shape[2]

    def local(q_l: Array, k_l: Array, v_l: Array, seg_l: Array) -> Array:
        if pick:  # the one K/V head this device's query heads share
            head = linear_axis_index(pick, mesh) * q_l.shape[2] // group
            k_l = jax.lax.dynamic_slice_in_dim(k_l, head, 1, axis=2)
            v_l = jax.lax.dynamic_slice_in_dim(v_l, head, 1, axis=2)
        with hooks.use(None):
            return attention(q_l, k_l, v_l, seg_l, impl=impl, **options)

    return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec),
                         out_specs=q_spec, check_vma=False)(q, k, v, segment_ids)
