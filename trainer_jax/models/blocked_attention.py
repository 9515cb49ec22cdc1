"""Blocked (flash-style) causal GQA attention in plain XLA, with a block-recomputing VJP.

The forward walks query blocks; for each it runs an online softmax over the key blocks the block
can see, keeping a running max ``m``, normaliser ``norm`` and fp32 accumulator, and saves only the
output and the log-sum-exp per query. The backward walks key blocks, recomputes each block's
probabilities from the saved log-sum-exp and accumulates dq, dk, dv. Neither pass holds more than
one ``[block, block]`` score tile per (row, head).

Visible key blocks of query block ``i``: from the block of the earliest segment start among the
block's first queries (over rows) to ``i`` (causal). Query blocks that may see key block ``j``:
from ``j`` to the block of the latest segment end among key block ``j``'s last keys. Both bounds
rely on segments being contiguous runs; ``visible`` masks exactly inside the walked blocks.

``forward_walk`` / ``backward_walk`` take the row position of every local query and key block
(``qgrid``, ``kgrid``), so the same walk serves self-attention, a device's zigzag query chunks
against the whole row (context parallelism's all-gather form) and against one visiting block
of keys (its ring form, ``trainer_jax/parallel/ring.py``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

Array = jax.Array
_NEG = float(jnp.finfo(jnp.float32).min)


def visible(q_idx: Array, k_idx: Array, q_seg: Array, k_seg: Array) -> Array:
    """Query ``q_idx`` sees key ``k_idx``: causal, same non-zero segment, or itself (padding)."""
    return ((k_idx <= q_idx) & (q_seg == k_seg) & (k_seg != 0)) | (q_idx == k_idx)


def run_bounds(segment_ids: Array) -> tuple[Array, Array]:
    """First and last index of the run of equal segment ids containing each position."""
    t = segment_ids.shape[1]
    idx = jnp.arange(t)
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                              segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    ends = jnp.concatenate([segment_ids[:, 1:] != segment_ids[:, :-1],
                            jnp.ones_like(segment_ids[:, :1], bool)], axis=1)
    first = jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)
    last = jax.lax.cummin(jnp.where(ends, idx, t - 1), axis=1, reverse=True)
    return first, last


def _tile_scores(qi, kj, seg_q, seg_k, q0, k0, scale):
    """Masked fp32 scores ``[B, K, G*bq, bk]`` of query tile ``qi [B, K, G, bq, hd]``."""
    b, kh, g, bq, hd = qi.shape
    s = jnp.einsum("bkgqd,bksd->bkgqs", qi, kj, preferred_element_type=jnp.float32) * scale
    qidx = q0 + jnp.arange(bq)
    kidx = k0 + jnp.arange(kj.shape[2])
    mask = visible(qidx[None, :, None], kidx[None, None, :], seg_q[:, :, None], seg_k[:, None, :])
    return jnp.where(mask[:, None, None], s, _NEG)


def _slice_t(x: Array, start, size: int, axis: int) -> Array:
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def forward_walk(q, k, v, seg_q, seg_k, qgrid, kgrid, lo, block: int, out_dtype):
    """Online-softmax forward of query blocks against key blocks placed anywhere in one row.

    ``q [B, K, G, Tq, hd]``, ``k, v [B, K, Tk, hd]``, ``seg_q [B, Tq]``, ``seg_k [B, Tk]``; local
    query block ``i`` sits at block ``qgrid[i]`` of the row, local key block ``j`` at ``kgrid[j]``
    (both increasing, may be traced); ``lo[i]``: the earliest row block query block ``i`` may see
    (its segment start). Each query block walks only the local key blocks in ``[lo[i], qgrid[i]]``
    (in the row's block grid): blocks in the causal future or before the segment are skipped.
    Returns ``(out [B, K, G, Tq, hd] in out_dtype, lse [B, K, G, Tq] fp32)``; a query that sees no
    key here gets ``out = 0`` and ``lse = _NEG`` (context parallelism's ring combines such parts).
    """
    b, kh, g, tq, hd = q.shape
    nq = tq // block
    scale = hd ** -0.5
    k_lo = jnp.searchsorted(kgrid, lo, side="left")       # local key blocks before lo
    k_hi = jnp.searchsorted(kgrid, qgrid, side="right")   # local key blocks at or before the query

    def query_block(_, xs):
        i, j_lo, j_hi, gi = xs
        qi = _slice_t(q, i * block, block, 3)
        seg_qi = _slice_t(seg_q, i * block, block, 1)

        def key_block(j, carry):
            m, norm, acc = carry
            kj, vj = _slice_t(k, j * block, block, 2), _slice_t(v, j * block, block, 2)
            s = _tile_scores(qi, kj, seg_qi, _slice_t(seg_k, j * block, block, 1),
                             gi * block, kgrid[j] * block, scale)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.exp(s - m_new[..., None])
            # Rows with nothing visible yet carry junk (exp(0) of masked scores); a later visible
            # score zeroes it through exp(m - m_new). Junk that survives a whole walk (nothing
            # visible in these keys) has lse ~ _NEG, which weighs nothing where parts combine.
            corr = jnp.exp(m - m_new)
            norm = norm * corr + jnp.sum(p, axis=-1)
            pv = jnp.einsum("bkgqs,bksd->bkgqd", p.astype(v.dtype), vj,
                            preferred_element_type=jnp.float32)
            return m_new, norm, acc * corr[..., None] + pv

        init = (jnp.full((b, kh, g, block), _NEG, jnp.float32),
                jnp.zeros((b, kh, g, block), jnp.float32),
                jnp.zeros((b, kh, g, block, hd), jnp.float32))
        m, norm, acc = jax.lax.fori_loop(j_lo, j_hi, key_block, init)
        seen = norm > 0  # false only where no key block was walked
        norm = jnp.where(seen, norm, 1.0)
        return None, ((acc / norm[..., None]).astype(out_dtype), jnp.where(seen, m + jnp.log(norm), _NEG))

    _, (out, lse) = jax.lax.scan(query_block, None, (jnp.arange(nq), k_lo, k_hi, qgrid))
    # [nq, B, K, G, block, ...] -> [B, K, G, Tq, ...]
    out = jnp.moveaxis(out, 0, 3).reshape(b, kh, g, tq, hd)
    lse = jnp.moveaxis(lse, 0, 3).reshape(b, kh, g, tq)
    return out, lse


def backward_walk(q, k, v, seg_q, seg_k, qgrid, kgrid, hi, dout, lse, delta, dq, block: int,
                  dkv_dtype):
    """The backward of ``forward_walk`` given the final ``lse`` and ``delta = sum(dout * out)``:
    walks key blocks, each over the local query blocks that may see it (row blocks in
    ``[kgrid[j], hi[j])``, ``hi[j]``: one past the block of the latest segment end among key block
    ``j``'s keys), recomputing the probabilities. Returns ``(dq + this part, dk, dv)``; dk/dv
    ``[B, K, Tk, hd]`` in ``dkv_dtype`` (complete per key block for these queries)."""
    b, kh, g, tq, hd = q.shape
    nk = k.shape[2] // block
    scale = hd ** -0.5
    i_lo = jnp.searchsorted(qgrid, kgrid, side="left")   # first local query block at or after j
    i_hi = jnp.searchsorted(qgrid, hi, side="left")      # local query blocks before hi

    def key_block(dq, xs):
        j, lo_i, hi_i, gj = xs
        kj, vj = _slice_t(k, j * block, block, 2), _slice_t(v, j * block, block, 2)
        seg_kj = _slice_t(seg_k, j * block, block, 1)

        def query_block(i, carry):
            dq, dk, dv = carry
            qi = _slice_t(q, i * block, block, 3)
            doi = _slice_t(dout, i * block, block, 3)
            s = _tile_scores(qi, kj, _slice_t(seg_q, i * block, block, 1), seg_kj,
                             qgrid[i] * block, gj * block, scale)
            p = jnp.exp(s - _slice_t(lse, i * block, block, 3)[..., None])
            dv = dv + jnp.einsum("bkgqs,bkgqd->bksd", p.astype(doi.dtype), doi,
                                 preferred_element_type=jnp.float32)
            dp = jnp.einsum("bkgqd,bksd->bkgqs", doi, vj, preferred_element_type=jnp.float32)
            ds = (p * (dp - _slice_t(delta, i * block, block, 3)[..., None]) * scale).astype(q.dtype)
            dk = dk + jnp.einsum("bkgqs,bkgqd->bksd", ds, qi, preferred_element_type=jnp.float32)
            dqi = _slice_t(dq, i * block, block, 3) + jnp.einsum(
                "bkgqs,bksd->bkgqd", ds, kj, preferred_element_type=jnp.float32)
            return jax.lax.dynamic_update_slice_in_dim(dq, dqi, i * block, axis=3), dk, dv

        zeros = jnp.zeros((b, kh, block, hd), jnp.float32)
        dq, dk, dv = jax.lax.fori_loop(lo_i, hi_i, query_block, (dq, zeros, zeros))
        return dq, (dk.astype(dkv_dtype), dv.astype(dkv_dtype))

    dq, (dk, dv) = jax.lax.scan(key_block, dq, (jnp.arange(nk), i_lo, i_hi, kgrid))
    dk = jnp.moveaxis(dk, 0, 2).reshape(b, kh, nk * block, hd)
    dv = jnp.moveaxis(dv, 0, 2).reshape(b, kh, nk * block, hd)
    return dq, dk, dv


def query_grid(qb0, nq: int):
    """Each local query block's block in the row: the queries are ``len(qb0)`` equal chunks,
    chunk ``h`` starting at row block ``qb0[h]``."""
    per = nq // qb0.shape[0]
    i = jnp.arange(nq)
    return qb0[i // per] + i % per


def segment_lo(first, qgrid, block: int):
    """Per query block: the row block of the earliest segment start among its first queries
    (over rows; ``first`` from ``run_bounds`` of the whole row's segment ids)."""
    return jnp.min(first[:, qgrid * block], axis=0) // block


def segment_hi(last, block: int):
    """Per row block of keys: one past the row block of the latest segment end among its last
    keys (over rows; ``last`` from ``run_bounds``)."""
    return jnp.max(last[:, block - 1::block], axis=0) // block + 1


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(q, k, v, seg_q, seg_k, qb0, block):
    return _flash_fwd(q, k, v, seg_q, seg_k, qb0, block)[0]


def _flash_fwd(q, k, v, seg_q, seg_k, qb0, block):
    """``q [B, K, G, Tq, hd]``: ``len(qb0)`` equal chunks of queries, chunk ``h`` at key positions
    ``qb0[h] * block + arange(Tq / len(qb0))`` (``qb0`` may be traced: context parallelism's zigzag
    chunks); ``k, v [B, K, Tk, hd]`` the whole row, ``seg_q [B, Tq]``, ``seg_k [B, Tk]``; chunk
    lengths and Tk multiples of block. ``qb0 = [0], Tq = Tk``: plain self-attention."""
    nq, nk = q.shape[3] // block, k.shape[2] // block
    first, _ = run_bounds(seg_k)
    qgrid = query_grid(qb0, nq)
    out, lse = forward_walk(q, k, v, seg_q, seg_k, qgrid, jnp.arange(nk), segment_lo(first, qgrid, block),
                            block, q.dtype)
    return out, (q, k, v, seg_q, seg_k, qb0, out, lse)


def _flash_bwd(block, res, dout):
    q, k, v, seg_q, seg_k, qb0, out, lse = res
    nq, nk = q.shape[3] // block, k.shape[2] // block
    _, last = run_bounds(seg_k)
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B,K,G,Tq]
    # dK/dV complete per key block: stored in K/V's dtype (half the stacked bytes in bf16).
    dq, dk, dv = backward_walk(q, k, v, seg_q, seg_k, query_grid(qb0, nq), jnp.arange(nk),
                               segment_hi(last, block), dout, lse, delta,
                               jnp.zeros(q.shape, jnp.float32), block, k.dtype)
    return dq.astype(q.dtype), dk, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def attention_blocked(q: Array, k: Array, v: Array, segment_ids: Array, *,
                      block: int = 128) -> Array:
    """Blocked causal GQA attention (module docstring); same contract as ``attention``."""
    b, t, h, hd = q.shape
    kh = k.shape[2]
    block = min(block, t)
    pad = -t % block
    # Padded positions are segment 0: each sees only itself and is cut off at the end.
    padt = [(0, 0), (0, pad), (0, 0), (0, 0)]
    qb = jnp.pad(q, padt).reshape(b, t + pad, kh, h // kh, hd).transpose(0, 2, 3, 1, 4)
    kb = jnp.pad(k, padt).transpose(0, 2, 1, 3)
    vb = jnp.pad(v, padt).transpose(0, 2, 1, 3)
    seg = jnp.pad(segment_ids, [(0, 0), (0, pad)])
    out = _flash(qb, kb, vb, seg, seg, jnp.zeros(1, jnp.int32), block)  # [B, K, G, Tp, hd]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t + pad, h, hd)[:, :t]


def attention_blocked_chunks(q: Array, k: Array, v: Array, seg_q: Array, seg_k: Array,
                             starts: Array, *, block: int) -> Array:
    """Queries ``q [B, Tq, H, hd]`` cut into ``len(starts)`` equal chunks, chunk ``h`` at positions
    ``starts[h] + arange(Tq / len(starts))`` of the key sequence ``k, v [B, Tk, K, hd]``
    (``seg_q`` is ``seg_k`` at those positions): the blocked attention of a device's query chunks
    against the whole row, as context parallelism runs it (one call for both zigzag chunks, so
    the backward accumulates one dK/dV).

    ``starts`` may be traced; the starts, the chunk length and ``Tk`` must be multiples of
    ``block`` (the caller picks a block dividing its chunk length). Same masking and result as
    the rows of ``attention_blocked`` on the whole sequence at those positions.
    """
    b, tq, h, hd = q.shape
    kh, tk = k.shape[2], k.shape[1]
    starts = jnp.asarray(starts, jnp.int32).reshape(-1)
    if tq % (starts.shape[0] * block) or tk % block:
        raise ValueError(f"{starts.shape[0]} query chunks of {tq} and key length {tk} must be "
                         f"multiples of block {block}")
    qb = q.reshape(b, tq, kh, h // kh, hd).transpose(0, 2, 3, 1, 4)
    kb, vb = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    out = _flash(qb, kb, vb, jnp.asarray(seg_q, jnp.int32), jnp.asarray(seg_k, jnp.int32),
                 starts // block, block)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, tq, h, hd)
