"""Grouped matmul for MoE experts: rows sorted by expert, each group times its own weight matrix.

``grouped_matmul(x [M, D], w [E, D, F], group_sizes [E]) -> [M, F]`` where rows
``sum(group_sizes[:e]) .. sum(group_sizes[:e+1])`` of ``x`` are multiplied by ``w[e]``.

Two implementations:
- ``ragged_dot``: ``jax.lax.ragged_dot``, a true grouped GEMM on GPU and TPU. XLA:CPU lowers it
  densely (every row against every expert, masked), which costs E times the useful work.
- ``blocked``: each group is padded to a multiple of ``block`` rows, and a scan runs one
  ``[block, D] @ [D, F]`` matmul per block with that block's expert. Work is the useful work plus
  at most ``E * block`` padding rows, with static shapes; the default on CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLS = ("ragged_dot", "blocked")


def default_impl() -> str:
    return "blocked" if jax.default_backend() == "cpu" else "ragged_dot"


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, impl: str | None = None,
                   block: int = 64, preferred_element_type=jnp.float32) -> jax.Array:
    impl = impl or default_impl()
    if impl == "ragged_dot":
        return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=preferred_element_type)
    if impl != "blocked":
        raise ValueError(f"grouped matmul impl {impl!r}: expected one of {IMPLS}")
    return _blocked(x, w, group_sizes, block, preferred_element_type)


def _blocked(x, w, group_sizes, block, out_dtype):
    m, d = x.shape
    e, _, f = w.shape
    group_sizes = group_sizes.astype(jnp.int32)
    padded_sizes = (group_sizes + block - 1) // block * block
    # Static bound on padded rows: every group may waste up to block - 1 rows.
    num_blocks = -(-m // block) + e
    starts = jnp.cumsum(group_sizes) - group_sizes
    padded_starts = jnp.cumsum(padded_sizes) - padded_sizes
    row_expert = jnp.repeat(jnp.arange(e), group_sizes, total_repeat_length=m)
    dest = padded_starts[row_expert] + jnp.arange(m) - starts[row_expert]

    xp = jnp.zeros((num_blocks * block, d), x.dtype).at[dest].set(x)
    # The expert of block j owns padded rows [padded_starts[e], padded_starts[e] + padded_sizes[e]).
    block_expert = jnp.searchsorted(jnp.cumsum(padded_sizes), jnp.arange(num_blocks) * block, side="right")
    block_expert = jnp.minimum(block_expert, e - 1)  # trailing all-zero blocks: any expert will do

    def one_block(_, inputs):
        xb, eb = inputs
        yb = jnp.dot(xb, jax.lax.dynamic_index_in_dim(w, eb, keepdims=False),
                     preferred_element_type=out_dtype)
        return None, yb

    _, yp = jax.lax.scan(one_block, None, (xp.reshape(num_blocks, block, d), block_expert))
    return yp.reshape(num_blocks * block, f)[dest]
