"""Ring attention over the ``context`` axis: K/V blocks travel, no device holds a whole row's K/V.

Context parallelism (``parallel/sequence.py``) leaves device ``c`` of ``C`` with the zigzag chunks
``c`` and ``2C - 1 - c`` (``L`` tokens each) of every row's queries, keys and values. Ring
attention runs ``C`` steps: at step ``s`` the device holds the K/V (and segment ids) of device
``d = c - s`` (mod ``C``), runs the blocked XLA kernel (``models/blocked_attention.forward_walk``)
of its own query chunks against those two key chunks at their true row positions, and passes the
block on to device ``c + 1`` with ``ppermute`` (issued before the step's compute, so the transfer
can overlap it; ``C - 1`` hops). Each step's part comes back normalised with its log-sum-exp and
the parts combine exactly (online softmax across steps). Causal skipping is the kernel's own: a
query block walks only the key blocks at or before it in the row and after its segment's start,
so with the zigzag layout every step after the first costs half a step (a device's early chunk
sees none of a later device's chunks, its late chunk sees all of them).

The backward (a ``custom_vjp``) runs the ring again: each device keeps ``dQ`` of its own queries,
and every visiting K/V block travels with its ``dK``/``dV`` accumulator (fp32), which after the
``C``-th hop is back on the block's owner. Both rings are loops (``fori_loop``; the last step
outside, with no hop after it), so a device holds its own ``2L`` positions plus one visiting
block of K/V and of their gradient (two while a transfer is in flight), never ``T``. Unrolled,
XLA:CPU's scheduler kept several steps' buffers live: 13.1 GiB of temporaries at 262,144 tokens
x context 8 at the Qwen3-0.6B shape, against 9.7 GiB as a loop.

The segment ids of the whole row *are* gathered (``[rows, T]`` int32, a thousandth of a K/V
gather at the Qwen3 shapes): the kernel's skip bounds need each query's segment start and each
key's segment end, which may lie on another device. The masks themselves use only the visiting
block's segment ids.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from trainer_jax.models.blocked_attention import (
    _NEG,
    backward_walk,
    forward_walk,
    run_bounds,
    segment_hi,
    segment_lo,
)

Array = jax.Array


def zigzag_grid(device: Array, size: int, chunk_blocks: int) -> Array:
    """Row blocks of a device's two zigzag chunks (``device`` and ``2 size - 1 - device``), in
    its local order (increasing)."""
    ar = jnp.arange(chunk_blocks)
    return jnp.concatenate([device * chunk_blocks + ar, (2 * size - 1 - device) * chunk_blocks + ar])


def _combine(out: Array, lse: Array, part: Array, part_lse: Array) -> tuple[Array, Array]:
    """Two normalised softmax-attention parts over disjoint keys -> their union's."""
    new = jnp.logaddexp(lse, part_lse)
    return (out * jnp.exp(lse - new)[..., None] + part * jnp.exp(part_lse - new)[..., None]), new


def _hop(tree, axis: str, size: int):
    return jax.lax.ppermute(tree, axis, [(i, (i + 1) % size) for i in range(size)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _ring(q, k, v, seg, lo, hi_all, device, axis, size, block):
    return _ring_fwd(q, k, v, seg, lo, hi_all, device, axis, size, block)[0]


def _ring_fwd(q, k, v, seg, lo, hi_all, device, axis, size, block):
    nb = q.shape[3] // (2 * block)
    qgrid = zigzag_grid(device, size, nb)

    def attend(s, visiting, out, lse):  # this step's part, combined into the running result
        kgrid = zigzag_grid((device - s) % size, size, nb)
        part, part_lse = forward_walk(q, visiting[0], visiting[1], seg, visiting[2], qgrid, kgrid,
                                      lo, block, jnp.float32)
        return _combine(out, lse, part, part_lse)

    def step(s, carry):
        visiting, out, lse = carry
        nxt = _hop(visiting, axis, size)  # independent of this step's compute: overlaps it
        return (nxt, *attend(s, visiting, out, lse))

    # A loop, not an unrolled ring: one visiting block (two while a hop is in flight) and one
    # running result live at a time whatever the scheduler does, and the kernel compiles once.
    init = ((k, v, seg), jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:4], _NEG, jnp.float32))
    visiting, out, lse = jax.lax.fori_loop(0, size - 1, step, init)
    out, lse = attend(size - 1, visiting, out, lse)  # the last block: no hop after it
    out = out.astype(q.dtype)
    return out, (q, k, v, seg, lo, hi_all, device, out, lse)


def _ring_bwd(axis, size, block, res, dout):
    q, k, v, seg, lo, hi_all, device, out, lse = res
    nb = q.shape[3] // (2 * block)
    qgrid = zigzag_grid(device, size, nb)
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)

    def grads_of(s, visiting, dq, grads):  # this block's dK/dV added, then on with the block
        kgrid = zigzag_grid((device - s) % size, size, nb)
        dq, dk, dv = backward_walk(q, visiting[0], visiting[1], seg, visiting[2], qgrid, kgrid,
                                   hi_all[kgrid], dout, lse, delta, dq, block, jnp.float32)
        return dq, _hop((grads[0] + dk, grads[1] + dv), axis, size)

    def step(s, carry):
        visiting, dq, grads = carry
        nxt = _hop(visiting, axis, size)
        return (nxt, *grads_of(s, visiting, dq, grads))

    zeros = jnp.zeros(k.shape, jnp.float32)
    init = ((k, v, seg), jnp.zeros(q.shape, jnp.float32), (zeros, zeros))
    visiting, dq, grads = jax.lax.fori_loop(0, size - 1, step, init)
    dq, (dk, dv) = grads_of(size - 1, visiting, dq, grads)  # the C-th hop took dK/dV home
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention_local(q: Array, k: Array, v: Array, seg: Array, seg_row: Array, *, axis: str,
                         size: int, block: int) -> Array:
    """Inside ``shard_map`` over ``axis`` (``size`` devices): this device's zigzag queries
    ``q [B, 2L, H, hd]`` against the whole row's keys, K/V ``[B, 2L, K, hd]`` and ``seg [B, 2L]``
    its own chunks, ``seg_row [B, T]`` the row's segment ids in original order (for the skip
    bounds). ``L`` must be a multiple of ``block``. Returns ``[B, 2L, H, hd]`` (module doc)."""
    b, t2, h, hd = q.shape
    kh = k.shape[2]
    if t2 % (2 * block):
        raise ValueError(f"two chunks of {t2 // 2} are not a multiple of block {block}")
    device = jax.lax.axis_index(axis)
    first, last = run_bounds(seg_row)
    lo = segment_lo(first, zigzag_grid(device, size, t2 // (2 * block)), block)
    hi_all = segment_hi(last, block)
    qb = q.reshape(b, t2, kh, h // kh, hd).transpose(0, 2, 3, 1, 4)
    kb, vb = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    out = _ring(qb, kb, vb, jnp.asarray(seg, jnp.int32), lo, hi_all, device, axis, size, block)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t2, h, hd)
