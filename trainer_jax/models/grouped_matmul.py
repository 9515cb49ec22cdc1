"""Grouped matmuls for MoE experts: each row times the weight matrix of its own group.

``grouped_matmul(x [M, D], w [E, D, F], group_sizes [E]) -> [M, F]`` where rows
``sum(group_sizes[:e]) .. sum(group_sizes[:e+1])`` of ``x`` are multiplied by ``w[e]``. Rows past
``sum(group_sizes)`` belong to no group and come out as zeros.

An expert FFN runs three grouped matmuls on the same grouping, so the grouping is a value of its
own, ``GroupedRows`` (from ``group_rows``, which takes each row's group in any order): ``pack``
moves the rows into the layout ``matmul`` works on, ``unpack`` brings them back, once per FFN
rather than once per matmul. Both moves are row gathers whose backward is the gather by the
inverse map (``_take_rows``, ``_combine_rows``), so neither direction scatters: autodiff of a
gather is a scatter-add, which XLA:CPU runs with index arrays as wide as the rows. With the
combine folded into the unpack (``unpack_combine``), a MoE layer's fwd+bwd at 8 x 256 tokens, 8
experts, top-2 went 57.6 -> 45-52 ms on the 2-core CPU host.

``pack`` can read each row from a smaller array, ``x[row // copies]``: a MoE's top-k copies of a
token are rows ``n * k .. n * k + k - 1``, so the copies are never materialised.

Two implementations:
- ``ragged_dot``: ``jax.lax.ragged_dot`` on the rows sorted by group; a true grouped GEMM on
  GPU and TPU. XLA:CPU lowers it densely (every row against every expert, masked), which costs E
  times the useful work.
- ``blocked``: each group is padded to a multiple of ``block`` rows, so the rows form
  ``[num_blocks, block, D]`` blocks of one expert each, and a matmul is one batched matmul of
  every block with its expert's weights. Work is the useful work plus fewer than ``E * block``
  padding rows, with static shapes; the default on CPU. (A scan of one matmul per block did the
  same work at twice the time on XLA:CPU, from per-iteration overhead.)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

Array = jax.Array
IMPLS = ("ragged_dot", "blocked")
# Rows per block of the blocked form. On the 2-core CPU host, an expert FFN's fwd+bwd over 4,096
# sorted rows x 8 experts (256 -> 128 -> 256) took 73 / 52 / 48 ms with blocks of 64 / 128 / 256;
# 128 wastes at most half as many padding rows as 256 when experts outnumber the rows per expert.
DEFAULT_BLOCK = 128


def default_impl() -> str:
    return "blocked" if jax.default_backend() == "cpu" else "ragged_dot"


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def _take_rows(x: Array, index: Array, valid: Array, back_index: Array, back_valid: Array,
               copies: int) -> Array:
    """``where(valid, x[index // copies], 0)``, with the gather ``back_index`` as its backward.

    ``index`` and ``back_index`` must be inverse maps on their valid entries: output row ``i``
    (valid) reads source row ``r = index[i]`` (of ``x`` repeated ``copies`` times) exactly when
    ``back_index[r] == i`` and ``back_valid[r]``. Then the cotangent of ``x``'s row ``n`` is the
    sum over its copies ``r`` of the output cotangent's row ``back_index[r]``: a gather, not the
    scatter-add autodiff would build.
    """
    return jnp.where(valid[:, None], x[index // copies], 0)


def _take_rows_fwd(x, index, valid, back_index, back_valid, copies):
    return _take_rows(x, index, valid, back_index, back_valid, copies), (back_index, back_valid)


def _take_rows_bwd(copies, residuals, g):
    back_index, back_valid = residuals
    gx = jnp.where(back_valid[:, None], g[back_index], 0)
    gx = gx.reshape(-1, copies, g.shape[-1]).sum(axis=1) if copies > 1 else gx
    return gx, None, None, None, None


_take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def _copies(y: Array, weights: Array, index: Array, valid: Array) -> Array:
    """``where(valid, y[index], 0)`` as ``[N, copies, F]`` (the copies of each token)."""
    return jnp.where(valid[:, None], y[index], 0).reshape(weights.shape + y.shape[-1:])


@partial(jax.custom_vjp, nondiff_argnums=(6,))
def _combine_rows(y: Array, weights: Array, index: Array, valid: Array, back_index: Array,
                  back_valid: Array, copies: int) -> Array:
    """``sum_j weights[n, j] * where(valid, y[index], 0)[n * copies + j]`` -> ``[N, F]``, with
    ``y``'s cotangent gathered through ``back_index`` (the inverse map, as in ``_take_rows``)."""
    return jnp.einsum("nkf,nk->nf", _copies(y, weights, index, valid), weights.astype(y.dtype))


def _combine_rows_fwd(y, weights, index, valid, back_index, back_valid, copies):
    rows = _copies(y, weights, index, valid)  # kept for the weights' gradient
    out = jnp.einsum("nkf,nk->nf", rows, weights.astype(y.dtype))
    return out, (rows, weights, back_index, back_valid)


def _combine_rows_bwd(copies, residuals, g):
    rows, weights, back_index, back_valid = residuals
    # Row s of y went to token back_index[s] // copies with that copy's weight.
    w_of_row = weights.reshape(-1)[back_index].astype(g.dtype)
    gy = jnp.where(back_valid[:, None], g[back_index // copies] * w_of_row[:, None], 0)
    gw = jnp.einsum("nkf,nf->nk", rows, g.astype(rows.dtype)).astype(weights.dtype)
    return gy.astype(rows.dtype), gw, None, None, None, None


_combine_rows.defvjp(_combine_rows_fwd, _combine_rows_bwd)


@dataclass(frozen=True)
class GroupedRows:
    """Where each of ``M`` rows goes for ``matmul`` (module docstring).

    ``group_sizes`` count each group's rows; ``packed_sizes`` are the group sizes in the packed
    layout (padded to whole blocks for ``blocked``), whose rows are sorted by group with zeros
    (padding, rows of no group) after each group's own.
    """

    impl: str
    group_sizes: Array
    packed_sizes: Array
    slot_of_row: Array  # [M]: the packed row each row goes to
    row_valid: Array  # [M]: the row belongs to a group
    row_of_slot: Array  # [P]: the row each packed row holds
    slot_valid: Array  # [P]: the packed row holds a row (not padding)
    block: int = 0
    block_group: Array | None = None  # blocked: the group of each block

    def pack(self, x: Array, *, copies: int = 1) -> Array:
        """Rows ``x[i // copies]`` (``x [M / copies, D]``) -> the packed layout (``[num_blocks,
        block, D]`` when blocked); with ``copies=k`` row ``i`` is copy ``i % k`` of ``x[i // k]``."""
        packed = _take_rows(x, self.row_of_slot, self.slot_valid, self.slot_of_row, self.row_valid,
                            copies)
        return packed if self.impl == "ragged_dot" else packed.reshape(-1, self.block, x.shape[1])

    def unpack(self, y: Array) -> Array:
        """The packed layout -> ``[M, F]`` in the rows' order (zeros for rows of no group)."""
        return _take_rows(self.rows(y), self.slot_of_row, self.row_valid, self.row_of_slot,
                          self.slot_valid, 1)

    def unpack_combine(self, y: Array, weights: Array) -> Array:
        """``unpack(y)`` summed over each token's copies with ``weights [N, k]`` (rows ``n * k ..
        n * k + k - 1`` are token ``n``'s) -> ``[N, F]``, in one gather each way."""
        return _combine_rows(self.rows(y), weights, self.slot_of_row, self.row_valid,
                             self.row_of_slot, self.slot_valid, weights.shape[1])

    def rows(self, y: Array) -> Array:
        """The packed layout as ``[rows, F]`` sorted by group, ``packed_sizes`` rows per group."""
        return y.reshape(-1, y.shape[-1])

    def matmul(self, xp: Array, w: Array, *, preferred_element_type=jnp.float32) -> Array:
        """Packed ``xp`` times ``w [E, D, F]`` per group, in the packed layout."""
        if self.impl == "ragged_dot":
            return jax.lax.ragged_dot(xp, w, self.group_sizes,
                                      preferred_element_type=preferred_element_type)
        return jnp.einsum("nbd,ndf->nbf", xp, w[self.block_group],
                          preferred_element_type=preferred_element_type)

    def matmul_pair(self, xp: Array, w1: Array, w2: Array, *,
                    preferred_element_type=jnp.float32) -> tuple[Array, Array]:
        """``matmul(xp, w1), matmul(xp, w2)`` (an FFN's gate and up): one batched matmul when
        blocked, against both weights side by side (XLA:CPU runs the twice-as-wide blocks faster:
        an expert FFN's fwd+bwd 49 -> 44 ms at 4,096 rows x 8 experts). Two ragged_dots otherwise,
        with no concatenated copy of the weights."""
        if self.impl == "ragged_dot":
            return (self.matmul(xp, w1, preferred_element_type=preferred_element_type),
                    self.matmul(xp, w2, preferred_element_type=preferred_element_type))
        both = self.matmul(xp, jnp.concatenate([w1, w2], axis=-1),
                           preferred_element_type=preferred_element_type)
        return both[..., :w1.shape[-1]], both[..., w1.shape[-1]:]


def group_rows(group_of_row: Array, num_groups: int, *, impl: str | None = None,
               block: int = DEFAULT_BLOCK) -> GroupedRows:
    """The layout of rows in any order, row ``i`` in group ``group_of_row[i]``; a value outside
    ``[0, num_groups)`` puts the row in no group (module docstring)."""
    impl = impl or default_impl()
    if impl not in IMPLS:
        raise ValueError(f"grouped matmul impl {impl!r}: expected one of {IMPLS}")
    num_rows = group_of_row.shape[0]
    row_valid = (group_of_row >= 0) & (group_of_row < num_groups)
    key = jnp.where(row_valid, group_of_row, num_groups)  # rows of no group sort last
    order = jnp.argsort(key, stable=True)  # the rows in group order
    row = jnp.arange(num_rows)
    rank = jnp.zeros(num_rows, jnp.int32).at[order].set(row.astype(jnp.int32))  # inverse of order
    group_sizes = jnp.bincount(key, length=num_groups + 1)[:num_groups].astype(jnp.int32)
    if impl == "ragged_dot":  # the sorted rows themselves; rows of no group after the groups
        return GroupedRows(impl, group_sizes, group_sizes, rank, row_valid, order,
                           row_valid[order])
    block = max(1, min(block, num_rows))
    padded_sizes = (group_sizes + block - 1) // block * block
    # Static bound: sum(ceil(g / block)) <= (M + E * (block - 1)) / block, since each group
    # wastes at most block - 1 rows.
    num_blocks = (num_rows + num_groups * (block - 1)) // block
    num_slots = num_blocks * block
    ends, padded_ends = jnp.cumsum(group_sizes), jnp.cumsum(padded_sizes)
    sorted_group = jnp.minimum(key[order], num_groups - 1)
    # The packed row of the row ranked r: its group's packed start plus its place in the group.
    slot_of_rank = (padded_ends - padded_sizes)[sorted_group] + row - (ends - group_sizes)[sorted_group]
    slot_of_row = jnp.where(row_valid, slot_of_rank[rank], num_slots)
    row_of_slot = jnp.zeros(num_slots, jnp.int32).at[slot_of_row].set(
        row.astype(jnp.int32), mode="drop")
    slot_valid = jnp.zeros(num_slots, bool).at[slot_of_row].set(True, mode="drop")
    slot_of_row = jnp.minimum(slot_of_row, num_slots - 1)  # masked by row_valid where clamped
    block_group = jnp.searchsorted(padded_ends, jnp.arange(num_blocks) * block, side="right")
    block_group = jnp.minimum(block_group, num_groups - 1)  # blocks past the groups: any will do
    return GroupedRows(impl, group_sizes, padded_sizes, slot_of_row, row_valid, row_of_slot,
                       slot_valid, block, block_group)


def grouped_matmul(x: Array, w: Array, group_sizes: Array, *, impl: str | None = None,
                   block: int = DEFAULT_BLOCK, preferred_element_type=jnp.float32) -> Array:
    """One grouped matmul of rows sorted by group (module docstring); several on one grouping:
    use ``group_rows``."""
    num_groups, num_rows = group_sizes.shape[0], x.shape[0]
    # Row i's group: the first group whose end passes i; num_groups for rows past every group.
    group_of_row = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(num_rows), side="right")
    rows = group_rows(group_of_row, num_groups, impl=impl, block=block)
    return rows.unpack(rows.matmul(rows.pack(x), w, preferred_element_type=preferred_element_type))
