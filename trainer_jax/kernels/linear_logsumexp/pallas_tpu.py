"""The ``"grid"`` Pallas layout: TPU (Mosaic).

The inner loop is the last, sequential ("arbitrary") grid axis, so Pallas pipelines the
HBM->VMEM copies of the tiles; accumulators live in VMEM scratch and the output block is written
on the last inner step. Ragged edge blocks are padded by Pallas with undefined values, so the
kernels mask them explicitly (logits -> -inf-like, operands -> 0). Blocks obey TPU tiling: token
block a multiple of 8 (or all of N), vocab tile a multiple of 128 (or all of V).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from trainer_jax.kernels.linear_logsumexp import _online
from trainer_jax.kernels.linear_logsumexp.pallas_common import (
    BlockSizes,
    KernelConfig,
    dot,
    iota,
    masked_logits,
    probs_times_g,
)

Array = jax.Array

# Untuned on real hardware (none was available); chosen to fit VMEM for D ~ 1-4k. The
# interpreter uses the same tiles.
DEFAULT_BLOCKS = BlockSizes(block_n=256, block_v=512)


def default_blocks(interpret: bool) -> BlockSizes:
    """The TPU tiles, interpreted or not."""
    del interpret
    return DEFAULT_BLOCKS


@dataclasses.dataclass(frozen=True)
class _GridShape:
    n: int
    d: int
    v: int
    bn: int
    bv: int

    @property
    def nb(self) -> int:
        return pl.cdiv(self.n, self.bn)

    @property
    def nv(self) -> int:
        return pl.cdiv(self.v, self.bv)

    def row_mask(self, i: Array) -> Array | None:
        return (i * self.bn + iota((self.bn, 1), 0)) < self.n if self.n % self.bn else None

    def col_mask(self, j: Array) -> Array | None:
        return (j * self.bv + iota((1, self.bv), 1)) < self.v if self.v % self.bv else None


def _grid_shape(h: Array, w: Array, cfg: KernelConfig) -> _GridShape:
    n, d = h.shape
    v = w.shape[1]
    block_n, block_v = cfg.blocks.block_n, cfg.blocks.block_v
    bn = n if n <= block_n else block_n
    bv = v if v <= block_v else block_v
    if bn != n and bn % 8:
        raise ValueError(f"grid layout: block_n must be a multiple of 8, got {bn}")
    if bv != v and bv % 128:
        raise ValueError(f"grid layout: block_v must be a multiple of 128, got {bv}")
    return _GridShape(n=n, d=d, v=v, bn=bn, bv=bv)


def _fwd_kernel(t_ref, h_ref, w_ref, lse_ref, ent_ref, m_sc, s_sc, a_sc, *, s: _GridShape):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        m_sc[...], s_sc[...], a_sc[...] = _online.init_carry(s.bn)

    z = masked_logits(h_ref[...], w_ref[...], t_ref[0], s.col_mask(j))
    m_sc[...], s_sc[...], a_sc[...] = _online.online_update((m_sc[...], s_sc[...], a_sc[...]), z)

    @pl.when(j == s.nv - 1)
    def _finish():
        lse_ref[...], ent_ref[...] = _online.finalize((m_sc[...], s_sc[...], a_sc[...]))


def _dh_kernel(t_ref, h_ref, w_ref, g_ref, lse_ref, dh_ref, acc_sc, *, s: _GridShape):
    j = pl.program_id(1)
    inv_t = t_ref[0]

    @pl.when(j == 0)
    def _init():
        acc_sc[...] = jnp.zeros_like(acc_sc)

    cm = s.col_mask(j)
    w = w_ref[...]
    if cm is not None:
        # The padded part of the last tile is undefined (maybe nan): 0 * nan would leak into dh.
        w = jnp.where(cm, w, jnp.zeros_like(w))
    dz = probs_times_g(masked_logits(h_ref[...], w, inv_t, cm), g_ref[...], lse_ref[...],
                       w.dtype)
    acc_sc[...] += dot(dz, w, contract=(1, 1))

    @pl.when(j == s.nv - 1)
    def _finish():
        dh_ref[...] = (acc_sc[...] * inv_t).astype(dh_ref.dtype)


def _dw_kernel(t_ref, h_ref, w_ref, g_ref, lse_ref, dw_ref, acc_sc, *, s: _GridShape):
    j, i = pl.program_id(0), pl.program_id(1)
    inv_t = t_ref[0]

    @pl.when(i == 0)
    def _init():
        acc_sc[...] = jnp.zeros_like(acc_sc)

    h, g, lse = h_ref[...], g_ref[...], lse_ref[...]
    rm = s.row_mask(i)
    if rm is not None:
        # Undefined padded rows would otherwise be summed into every column of dw.
        h = jnp.where(rm, h, jnp.zeros_like(h))
        g = jnp.where(rm, g, 0.0)
        lse = jnp.where(rm, lse, 0.0)
    dz = probs_times_g(masked_logits(h, w_ref[...], inv_t, s.col_mask(j)), g, lse, h.dtype)
    acc_sc[...] += dot(h, dz, contract=(0, 0))

    @pl.when(i == s.nb - 1)
    def _finish():
        dw_ref[...] = (acc_sc[...] * inv_t).astype(dw_ref.dtype)


def _tpu_params() -> pltpu.CompilerParams:
    # Outer axis independent (megacore may split it); inner axis carries the accumulators.
    return pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))


_SCALAR_SPEC = pl.BlockSpec(memory_space=pltpu.SMEM)


def forward(h: Array, w: Array, inv_t: Array, cfg: KernelConfig) -> tuple[Array, Array]:
    """(lse, entropy), each [N, 1] float32; ``inv_t`` is 1 / temperature, shape [1]."""
    s = _grid_shape(h, w, cfg)
    col = jax.ShapeDtypeStruct((s.n, 1), jnp.float32)
    rows = pl.BlockSpec((s.bn, 1), lambda i, j: (i, 0))
    return pl.pallas_call(
        partial(_fwd_kernel, s=s),
        out_shape=(col, col),
        grid=(s.nb, s.nv),
        in_specs=[
            _SCALAR_SPEC,
            pl.BlockSpec((s.bn, s.d), lambda i, j: (i, 0)),
            pl.BlockSpec((s.d, s.bv), lambda i, j: (0, j)),
        ],
        out_specs=(rows, rows),
        scratch_shapes=[pltpu.VMEM((s.bn, 1), jnp.float32)] * 3,
        compiler_params=_tpu_params(),
        interpret=cfg.interpret,
        name="linear_lse_fwd",
    )(inv_t, h, w)


def backward(
    h: Array, w: Array, inv_t: Array, g: Array, lse: Array, cfg: KernelConfig
) -> tuple[Array, Array]:
    """(dh, dw) of sum(g * lse) for g, lse [N, 1] float32, in the dtypes of h and w."""
    s = _grid_shape(h, w, cfg)
    dh = pl.pallas_call(
        partial(_dh_kernel, s=s),
        out_shape=jax.ShapeDtypeStruct(h.shape, h.dtype),
        grid=(s.nb, s.nv),
        in_specs=[
            _SCALAR_SPEC,
            pl.BlockSpec((s.bn, s.d), lambda i, j: (i, 0)),
            pl.BlockSpec((s.d, s.bv), lambda i, j: (0, j)),
            pl.BlockSpec((s.bn, 1), lambda i, j: (i, 0)),
            pl.BlockSpec((s.bn, 1), lambda i, j: (i, 0)),
        ],
        out_specs=pl.BlockSpec((s.bn, s.d), lambda i, j: (i, 0)),
        scratch_shapes=[pltpu.VMEM((s.bn, s.d), jnp.float32)],
        compiler_params=_tpu_params(),
        interpret=cfg.interpret,
        name="linear_lse_dh",
    )(inv_t, h, w, g, lse)
    dw = pl.pallas_call(
        partial(_dw_kernel, s=s),
        out_shape=jax.ShapeDtypeStruct(w.shape, w.dtype),
        grid=(s.nv, s.nb),
        in_specs=[
            _SCALAR_SPEC,
            pl.BlockSpec((s.bn, s.d), lambda j, i: (i, 0)),
            pl.BlockSpec((s.d, s.bv), lambda j, i: (0, j)),
            pl.BlockSpec((s.bn, 1), lambda j, i: (i, 0)),
            pl.BlockSpec((s.bn, 1), lambda j, i: (i, 0)),
        ],
        out_specs=pl.BlockSpec((s.d, s.bv), lambda j, i: (0, j)),
        scratch_shapes=[pltpu.VMEM((s.d, s.bv), jnp.float32)],
        compiler_params=_tpu_params(),
        interpret=cfg.interpret,
        name="linear_lse_dw",
    )(inv_t, h, w, g, lse)
    return dh, dw
