"""Context parallelism: each packed row's sequence split over the ``context`` mesh axis.

A row of ``T`` tokens is cut into ``2C`` chunks of ``L = T / 2C`` (``C`` = the context axis size)
laid out *zigzag*: device ``c`` holds chunks ``c`` and ``2C - 1 - c``, so under the causal mask
every device has the same amount of attention work (an early chunk sees little, its partner at
the end sees nearly everything). The permutation is applied to the step's inputs once
(``layout_inputs``: ids, segment ids, positions; the policy tokens' columns remapped); everything
position-wise (embedding, norms, projections, MLP, MoE, RoPE from the carried positions) then
runs on each device's ``T / C`` positions with no communication. Two places need the whole row:

- **Attention** (``context_attention``), in one of two forms (``mesh.context_attention``):
  ``ring`` (the default, ``parallel/ring.py``): K/V blocks travel round the axis with
  ``ppermute`` (``C - 1`` hops, each overlappable with a step of compute), every device runs the
  blocked XLA kernel for its two query chunks against the visiting block and combines the parts
  by their log-sum-exp; the backward passes dK/dV round with their blocks. No device holds more
  than its own and one visiting block of a row's K/V or their gradient. ``all_gather``: per
  layer, each device all-gathers the row's K/V (and segment ids) over ``context`` -
  ``[rows, T, K_local, hd]``, the K/V heads only, never the ``[rows, T, D]`` hidden states -
  restores the original order, and runs the blocked XLA kernel (``attention_blocked_chunks``)
  for its two query chunks against the whole row; the backward's dK/dV go back with a
  reduce-scatter (the all-gather's transpose). One collective instead of ``C - 1``, the same
  bytes moved, but the whole row's K/V and their gradient on every device (measured in
  ``docs/scale_out.md``). Both gather the row's segment ids (``[rows, T]`` int32).
- **The policy tokens' gather** (``token_gather``): the loss reads the hidden state before each of
  the step's ``N`` policy tokens, wherever its row and column live. A ring over every device
  that holds part of the rows (the batch axes and ``context``): each device gathers the tokens of
  one ``N / S`` slice that fall in its block (zeros elsewhere), adds them to the partial sums
  passed along the ring (``ppermute``), and after ``S - 1`` hops holds its own slice complete, so
  the tokens come out split over ``(batch axes, context)`` and no device holds more than ``N / S``
  of them or any other device's ``[rows, T, D]`` block.

The loss (vocabulary-parallel, tokens over the ``tokens`` logical axis), the MoE dispatch (tokens
of ``[rows, T]`` over batch axes and context) and the optimizer then compose unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from trainer_jax.models.attention import CPU_BLOCK
from trainer_jax.models.blocked_attention import attention_blocked_chunks
from trainer_jax.parallel import hooks
from trainer_jax.parallel.attention import head_layout
from trainer_jax.parallel.context import ParallelContext, linear_axis_index
from trainer_jax.parallel.ring import ring_attention_local
from trainer_jax.parallel.rules import spec_axes

Array = jax.Array
AXIS = "context"


def context_size(mesh: Any) -> int:
    """The size of the mesh's ``context`` axis (1 on meshes without one)."""
    return int(dict(mesh.shape).get(AXIS, 1))


def check_row_len(row_len: int, context: int) -> None:
    """Rows split into ``2 * context`` zigzag chunks: ``row_len`` must be a multiple of it."""
    if context > 1 and row_len % (2 * context):
        raise ValueError(f"row length {row_len} is not a multiple of 2 x mesh.context = {2 * context} "
                         f"(the zigzag layout cuts every row into 2 x context chunks)")


def zigzag_order(t: int, context: int) -> np.ndarray:
    """``order[i]``: the original position held at layout position ``i`` (device ``c`` holds
    layout positions ``[c T/C, (c+1) T/C)``: original chunks ``c`` and ``2C - 1 - c``)."""
    check_row_len(t, context)
    chunk = t // (2 * context)
    parts = []
    for c in range(context):
        parts += [np.arange(c * chunk, (c + 1) * chunk),
                  np.arange((2 * context - 1 - c) * chunk, (2 * context - c) * chunk)]
    return np.concatenate(parts)


def layout_inputs(ctx: ParallelContext, inputs: Any) -> Any:
    """A ``PackedInputs`` in the zigzag layout, each row's sequence split over ``context``."""
    from trainer_jax.batching import PackedInputs

    t = inputs.input_ids.shape[1]
    order = zigzag_order(t, context_size(ctx.mesh))
    inverse = np.argsort(order).astype(np.int32)
    permute = lambda x: ctx.constrain(jnp.take(x, order, axis=1), ("batch", "seq"))
    return PackedInputs(input_ids=permute(inputs.input_ids), segment_ids=permute(inputs.segment_ids),
                        positions=permute(inputs.positions), token_rows=inputs.token_rows,
                        token_cols=jnp.asarray(inverse)[inputs.token_cols])


def _chunk_block(chunk: int, block: int) -> int:
    """The largest block dividing the chunk length that is at most ``block``."""
    return math.gcd(chunk, block)


def context_attention(ctx: ParallelContext, q: Array, k: Array, v: Array, segment_ids: Array, *,
                      impl: str | None = None, **options: Any) -> Array:
    """Attention of zigzag-laid-out rows whose sequence is split over ``context`` (module doc).

    Rows and heads are split as in ``parallel.attention`` (the K/V head picking included). Each
    device runs the blocked XLA kernel whatever ``impl`` names: the fused kernels take no query
    offset (``docs/scale_out.md``, limits).
    """
    mesh = ctx.mesh
    c_size = context_size(mesh)
    ring = ctx.context_attention == "ring"
    q_inner, kv_inner, pick = head_layout(ctx, q.shape, k.shape)
    q_spec = P(q_inner[0], AXIS, *q_inner[2:])
    kv_spec = P(kv_inner[0], AXIS, *kv_inner[2:])
    seg_spec = P(q_inner[0], AXIS)
    group = q.shape[2] // k.shape[2]
    t = q.shape[1]
    chunk = t // (2 * c_size)
    block = _chunk_block(chunk, int(options.get("block", CPU_BLOCK)))
    # Layout chunk m (device m // 2, its half m % 2) holds original chunk c or 2C - 1 - c.
    held = [m // 2 if m % 2 == 0 else 2 * c_size - 1 - m // 2 for m in range(2 * c_size)]
    at = np.argsort(held)  # at[o]: the layout chunk holding original chunk o

    def original(x: Array) -> Array:
        b = x.shape[0]
        return jnp.take(x.reshape(b, 2 * c_size, chunk, *x.shape[2:]), at, axis=1).reshape(b, t, *x.shape[2:])

    def local(q_l: Array, k_l: Array, v_l: Array, seg_l: Array) -> Array:
        if pick:  # the one K/V head this device's query heads share
            head = linear_axis_index(pick, mesh) * q_l.shape[2] // group
            k_l = jax.lax.dynamic_slice_in_dim(k_l, head, 1, axis=2)
            v_l = jax.lax.dynamic_slice_in_dim(v_l, head, 1, axis=2)
        gather = lambda x: original(jax.lax.all_gather(x, AXIS, axis=1, tiled=True))
        seg_row = gather(seg_l)
        with hooks.use(None):
            if ring:
                return ring_attention_local(q_l, k_l, v_l, seg_l, seg_row, axis=AXIS, size=c_size,
                                            block=block)
            c = jax.lax.axis_index(AXIS)
            starts = jnp.stack([c, 2 * c_size - 1 - c]) * chunk  # this device's two original chunks
            return attention_blocked_chunks(q_l, gather(k_l), gather(v_l), seg_l, seg_row, starts,
                                            block=block)

    return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec),
                         out_specs=q_spec, check_vma=False)(q, k, v, segment_ids)


def token_gather(ctx: ParallelContext, hidden: Array, rows: Array, cols: Array) -> Array:
    """``hidden[rows, cols]`` (``[R, T, D]`` -> ``[N, D]``) by a ring over the devices holding the
    rows' blocks; the result split over (batch axes, context) (module docstring)."""
    mesh, rules = ctx.mesh, ctx.rules
    h_spec = rules.spec(("batch", "seq", None), hidden.shape, mesh)
    batch_axes, seq_axes = spec_axes(h_spec, 0), spec_axes(h_spec, 1)
    ring = batch_axes + seq_axes
    size = math.prod(mesh.shape[a] for a in ring)
    n = rows.shape[0]
    pad = -n % size
    if pad:  # padding tokens point nowhere: zeros, cut off below
        rows = jnp.concatenate([rows, jnp.full((pad,), -1, rows.dtype)])
        cols = jnp.concatenate([cols, jnp.full((pad,), -1, cols.dtype)])
    per = (n + pad) // size
    h_in = P(batch_axes or None, seq_axes or None)

    def local(h_l: Array, rows_a: Array, cols_a: Array) -> Array:
        r_l, t_l = h_l.shape[:2]
        me = linear_axis_index(ring, mesh) if ring else jnp.int32(0)
        r0 = (linear_axis_index(batch_axes, mesh) if batch_axes else 0) * r_l
        t0 = (linear_axis_index(seq_axes, mesh) if seq_axes else 0) * t_l

        def mine(j: Array) -> Array:  # my block's part of token slice j
            r = jax.lax.dynamic_slice_in_dim(rows_a, j * per, per) - r0
            t = jax.lax.dynamic_slice_in_dim(cols_a, j * per, per) - t0
            here = (r >= 0) & (r < r_l) & (t >= 0) & (t < t_l)
            got = h_l[jnp.clip(r, 0, r_l - 1), jnp.clip(t, 0, t_l - 1)]
            return jnp.where(here[:, None], got, jnp.zeros((), h_l.dtype))

        acc = mine((me - 1) % size)
        for step in range(1, size):
            acc = jax.lax.ppermute(acc, ring, [(i, (i + 1) % size) for i in range(size)])
            acc = acc + mine((me - step - 1) % size)
        return acc

    out = jax.shard_map(local, mesh=mesh, in_specs=(h_in, P(), P()),
                        out_specs=P(ring or None, None), check_vma=False)(hidden, rows, cols)
    return out[:n] if pad else out
