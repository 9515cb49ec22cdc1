"""Pieces shared by the two Pallas layouts: block sizes, kernel config and the per-tile math.

Math (z = h w / T, p = softmax(z), g = d loss / d lse):

    forward  lse = m + log s, entropy = log s - a / s     (online accumulators, see ``_online``)
    backward dZ = g p,  dh = dZ w^T / T,  dw = h^T dZ / T   (logits recomputed tile by tile)

Both layouts (``pallas_gpu``: "loop", ``pallas_tpu``: "grid") run the same three kernels --
forward and dh over token blocks looping over vocabulary tiles, dw over vocabulary tiles looping
over token blocks -- and differ only in where the inner loop lives and how ragged edges are
masked; the tile arithmetic below is common to both.

bf16 inputs feed the matmuls directly with fp32 accumulation; dZ is cast to the input dtype
for the two backward matmuls (as in flash attention). f32 inputs use full-precision matmuls.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
from jax import lax

from trainer_jax.kernels.linear_logsumexp import _online

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Pallas tile sizes: ``block_n`` tokens per block, ``block_v`` vocabulary columns per tile.

    Positive integers (numpy integers are converted to ``int`` so that equal sizes hash alike
    as a static jit argument). Layout-specific rules (powers of two on Triton, multiples of 8 and
    128 on TPU) depend on N and V and are applied by each layout when it sizes its tiles. The
    hidden size D is never tiled: each layout takes all of it (rounded up on Triton).
    """

    block_n: int
    block_v: int

    def __post_init__(self) -> None:
        for name in ("block_n", "block_v"):
            value = getattr(self, name)
            # bool is an int subclass, and float would be truncated silently: both are mistakes.
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(
                    f"{name} must be a positive int, got {value!r} ({type(value).__name__})"
                )
            object.__setattr__(self, name, int(value))
        if self.block_n < 1 or self.block_v < 1:
            raise ValueError(
                f"block sizes must be positive, got block_n={self.block_n}, "
                f"block_v={self.block_v}"
            )

    def replace(self, *, block_n: int | None = None, block_v: int | None = None) -> BlockSizes:
        """A copy with the given sizes overridden (``None`` keeps this one's)."""
        return BlockSizes(
            block_n=self.block_n if block_n is None else block_n,
            block_v=self.block_v if block_v is None else block_v,
        )

    def as_options(self) -> tuple[tuple[str, int], ...]:
        """``(("block_n", n), ("block_v", v))``: the form ``ObjectiveConfig.kernel_options`` takes."""
        return (("block_n", self.block_n), ("block_v", self.block_v))


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static (hashable) choices of one call: a ``nondiff_argnums`` entry of the custom_vjp."""

    layout: str
    blocks: BlockSizes
    interpret: bool


def dot(a: Array, b: Array, contract: tuple[int, int] = (1, 0)) -> Array:
    """fp32-accumulating matmul contracting a's axis contract[0] with b's axis contract[1]."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def iota(shape: tuple[int, int], axis: int) -> Array:
    """int32 indices along ``axis`` of a 2-D ``shape`` (masks must be 2-D inside TPU kernels)."""
    return lax.broadcasted_iota(jnp.int32, shape, axis)


def masked_logits(h: Array, w: Array, inv_t: Array, col_mask: Array | None) -> Array:
    """fp32 logits of a tile; columns outside the vocabulary become ``_online.NEG``."""
    z = dot(h, w) * inv_t
    return z if col_mask is None else jnp.where(col_mask, z, _online.NEG)


def probs_times_g(z: Array, g: Array, lse: Array, dtype: jnp.dtype) -> Array:
    """dZ = g p for a tile, in the matmul operand dtype of the backward."""
    # Masked logits are NEG, so their exp underflows to exactly 0: no extra select needed.
    return (g * jnp.exp(z - lse)).astype(dtype)
