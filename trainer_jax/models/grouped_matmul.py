"""Grouped matmuls for MoE experts: rows sorted by expert, each group times its own weight matrix.

``grouped_matmul(x [M, D], w [E, D, F], group_sizes [E]) -> [M, F]`` where rows
``sum(group_sizes[:e]) .. sum(group_sizes[:e+1])`` of ``x`` are multiplied by ``w[e]``. Rows past
``sum(group_sizes)`` belong to no group: what comes out there is unspecified (the expert-parallel
dispatch, ``trainer_jax.parallel.moe``, zeroes those rows and their combine weights).

An expert FFN runs three grouped matmuls on the same grouping, so the grouping is a value of its
own, ``GroupedRows`` (from ``group_rows``): ``pack`` puts the sorted rows into the layout its
``matmul`` works on, ``unpack`` takes them back, once per FFN rather than once per matmul.

Two implementations:
- ``ragged_dot``: ``jax.lax.ragged_dot`` on the sorted rows as they are; a true grouped GEMM on
  GPU and TPU. XLA:CPU lowers it densely (every row against every expert, masked), which costs E
  times the useful work.
- ``blocked``: each group is padded to a multiple of ``block`` rows, so the rows form
  ``[num_blocks, block, D]`` blocks of one expert each, and a matmul is one batched matmul of
  every block with its expert's weights. Work is the useful work plus at most ``E * block``
  padding rows, with static shapes; the default on CPU. (A scan of one matmul per block did the
  same work at twice the time on XLA:CPU, from per-iteration overhead.)
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class GroupedRows:
    """How ``M`` rows sorted by group are laid out for ``matmul`` (module docstring).

    ``packed_sizes`` are the group sizes in the packed layout (padded to whole blocks for
    ``blocked``); ``packed`` rows past their sum are padding.
    """

    impl: str
    group_sizes: Array
    packed_sizes: Array
    block: int = 0
    dest: Array | None = None  # blocked: the packed row of each input row
    block_group: Array | None = None  # blocked: the group of each block

    def pack(self, x: Array) -> Array:
        """``x [M, D]`` -> the packed layout (``[num_blocks, block, D]`` when blocked)."""
        if self.impl == "ragged_dot":
            return x
        num_blocks = self.block_group.shape[0]
        packed = jnp.zeros((num_blocks * self.block, x.shape[1]), x.dtype).at[self.dest].set(x)
        return packed.reshape(num_blocks, self.block, x.shape[1])

    def unpack(self, y: Array) -> Array:
        """The packed layout -> ``[M, F]`` rows in the input order."""
        if self.impl == "ragged_dot":
            return y
        return self.rows(y)[self.dest]

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


def group_rows(group_sizes: Array, num_rows: int, *, impl: str | None = None,
               block: int = DEFAULT_BLOCK) -> GroupedRows:
    """The layout of ``num_rows`` rows sorted into groups of ``group_sizes`` (module docstring)."""
    impl = impl or default_impl()
    if impl not in IMPLS:
        raise ValueError(f"grouped matmul impl {impl!r}: expected one of {IMPLS}")
    group_sizes = group_sizes.astype(jnp.int32)
    if impl == "ragged_dot":
        return GroupedRows(impl, group_sizes, group_sizes)
    e = group_sizes.shape[0]
    block = max(1, min(block, num_rows))
    padded_sizes = (group_sizes + block - 1) // block * block
    # Static bound on the blocks: every group may waste up to block - 1 rows.
    num_blocks = -(-num_rows // block) + e
    ends, padded_ends = jnp.cumsum(group_sizes), jnp.cumsum(padded_sizes)
    row = jnp.arange(num_rows)
    row_group = jnp.repeat(jnp.arange(e), group_sizes, total_repeat_length=num_rows)
    dest = (padded_ends - padded_sizes)[row_group] + row - (ends - group_sizes)[row_group]
    # Rows past sum(group_sizes) (repeat counts them in the last group) go to the spare blocks
    # after the last group, which the bound leaves free, so no group's padding is overwritten.
    dest = jnp.where(row < ends[-1], dest, padded_ends[-1] + row - ends[-1])
    block_group = jnp.searchsorted(padded_ends, jnp.arange(num_blocks) * block, side="right")
    block_group = jnp.minimum(block_group, e - 1)  # spare blocks: any expert will do
    return GroupedRows(impl, group_sizes, padded_sizes, block, dest, block_group)


def grouped_matmul(x: Array, w: Array, group_sizes: Array, *, impl: str | None = None,
                   block: int = DEFAULT_BLOCK, preferred_element_type=jnp.float32) -> Array:
    """One grouped matmul (module docstring); several on one grouping: use ``group_rows``."""
    rows = group_rows(group_sizes, x.shape[0], impl=impl, block=block)
    return rows.unpack(rows.matmul(rows.pack(x), w, preferred_element_type=preferred_element_type))
