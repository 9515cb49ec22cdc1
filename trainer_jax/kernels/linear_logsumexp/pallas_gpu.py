"""The ``"loop"`` Pallas layout: GPU (Triton) and the CPU interpreter.

The grid is only over the outer axis (token blocks for forward and dh, vocabulary tiles for dw)
and the inner loop is a ``fori_loop`` inside the kernel, reading tiles of whole-array refs
(global memory on GPU) with *masked* loads. Masks cover the ragged last token block and
vocabulary tile and a hidden size D that is not a power of two (Triton tiles must be), so nothing
is padded in HBM. Accumulators (running max/sum, dh rows, dw columns) live in registers and each
output block is stored once, masked, by the one program that owns it: no read-modify-write, no
atomics.

In the interpreter the vocabulary is swept as full tiles plus one remainder tile of static width
instead (see ``_LoopShape.split_v``), and D is not rounded up.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

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

# Untuned on real hardware (none was available); chosen to fit registers/shared memory for
# D ~ 1-4k on GPU.
DEFAULT_BLOCKS = BlockSizes(block_n=32, block_v=64)
# In the CPU interpreter every tile is a separate XLA step: bigger tiles amortise that (measured
# ~3x faster than (32, 64) at N=2048, D=1024, V=32k; temp memory stays ~30 MiB).
INTERPRET_BLOCKS = BlockSizes(block_n=512, block_v=2048)


def default_blocks(interpret: bool) -> BlockSizes:
    """Tiles for Triton, or the interpreter's larger ones."""
    return INTERPRET_BLOCKS if interpret else DEFAULT_BLOCKS


@dataclasses.dataclass(frozen=True)
class _LoopShape:
    n: int
    d: int
    v: int
    bn: int
    bd: int  # D rounded up to a power of two (Triton block dims must be powers of two)
    bv: int
    # Interpreter: the vocabulary is swept as full tiles plus one remainder tile of static width
    # V % bv instead of a masked tile that reaches past V. A tile past the end of w makes the
    # interpreter pad w and dw to a tile multiple -- full-size copies (2.4 GiB at Qwen3's V) that
    # Triton's masked loads never make. Triton needs power-of-two tiles, so it keeps the mask.
    split_v: bool = False

    @property
    def full_tiles(self) -> int:
        """Vocabulary tiles the main loop covers (all of them, the ragged one masked, unless split)."""
        return self.v // self.bv if self.split_v else pl.cdiv(self.v, self.bv)

    @property
    def rem(self) -> int:
        """Width of the separate remainder tile (0: none)."""
        return self.v % self.bv if self.split_v else 0

    def row_mask(self, r0: Array) -> Array | None:
        return (r0 + iota((self.bn, 1), 0)) < self.n if self.n % self.bn else None

    def col_mask(self, c0: Array, width: int) -> Array | None:
        if self.split_v or not self.v % self.bv:
            return None
        return (c0 + iota((1, width), 1)) < self.v

    def d_mask(self, axis: int) -> Array | None:
        if self.bd == self.d:
            return None
        shape = (1, self.bd) if axis == 1 else (self.bd, 1)
        return iota(shape, axis) < self.d


def _loop_shape(h: Array, w: Array, cfg: KernelConfig) -> _LoopShape:
    n, d = h.shape
    v = w.shape[1]
    block_n, block_v = cfg.blocks.block_n, cfg.blocks.block_v
    # Power-of-two tiles (Triton), at least 16 (tl.dot), no larger than needed.
    bn = max(16, min(block_n, pl.next_power_of_2(n)))
    bv = max(16, min(block_v, pl.next_power_of_2(v)))
    # The interpreter takes any D and tile width; rounding up there would pad h and w.
    bd = d if cfg.interpret else max(16, pl.next_power_of_2(d))
    if cfg.interpret:
        bv = min(block_v, v)
    return _LoopShape(n=n, d=d, v=v, bn=bn, bd=bd, bv=bv, split_v=cfg.interpret)


def _and(*masks: Array | None) -> Array | None:
    out = None
    for m in masks:
        if m is not None:
            out = m if out is None else out & m
    return out


def _load(ref, mask: Array | None) -> Array:
    if mask is None:
        return ref[...]
    mask = jnp.broadcast_to(mask, ref.shape)
    return plgpu.load(ref, mask=mask, other=0)


def _store(ref, value: Array, mask: Array | None) -> None:
    if mask is None:
        ref[...] = value
    else:
        plgpu.store(ref, value, mask=jnp.broadcast_to(mask, ref.shape))


def _loop_tiles(s: _LoopShape, h_ref, w_ref, r0: Array, c0: Array, width: int):
    """Loads h[rows, :] and w[:, c0:c0 + width] (zeros outside the arrays)."""
    rm, cm = s.row_mask(r0), s.col_mask(c0, width)
    h = _load(h_ref.at[pl.ds(r0, s.bn), pl.ds(0, s.bd)], _and(rm, s.d_mask(1)))
    w = _load(w_ref.at[pl.ds(0, s.bd), pl.ds(c0, width)], _and(s.d_mask(0), cm))
    return h, w, rm, cm


def _sweep_vocab(s: _LoopShape, tile, carry):
    """``carry = tile(carry, c0, width)`` over the vocabulary: full tiles, then the remainder."""
    carry = lax.fori_loop(0, s.full_tiles, lambda j, c: tile(c, j * s.bv, s.bv), carry)
    if s.rem:
        carry = tile(carry, s.full_tiles * s.bv, s.rem)
    return carry


def _fwd_kernel(t_ref, h_ref, w_ref, lse_ref, ent_ref, *, s: _LoopShape):
    r0 = pl.program_id(0) * s.bn
    inv_t = t_ref[0]

    def tile(carry, c0, width):
        h, w, _, cm = _loop_tiles(s, h_ref, w_ref, r0, c0, width)
        return _online.online_update(carry, masked_logits(h, w, inv_t, cm))

    lse, ent = _online.finalize(_sweep_vocab(s, tile, _online.init_carry(s.bn)))
    rm = s.row_mask(r0)
    _store(lse_ref.at[pl.ds(r0, s.bn), :], lse, rm)
    _store(ent_ref.at[pl.ds(r0, s.bn), :], ent, rm)


def _dh_kernel(t_ref, h_ref, w_ref, g_ref, lse_ref, dh_ref, *, s: _LoopShape):
    r0 = pl.program_id(0) * s.bn
    inv_t = t_ref[0]
    rm = s.row_mask(r0)
    g = _load(g_ref.at[pl.ds(r0, s.bn), :], rm)  # ragged rows: g = 0, so dZ = 0
    lse = _load(lse_ref.at[pl.ds(r0, s.bn), :], rm)

    def tile(acc, c0, width):
        h, w, _, cm = _loop_tiles(s, h_ref, w_ref, r0, c0, width)
        dz = probs_times_g(masked_logits(h, w, inv_t, cm), g, lse, w.dtype)
        return acc + dot(dz, w, contract=(1, 1))  # dZ w^T: [bn, bd]

    acc = _sweep_vocab(s, tile, jnp.zeros((s.bn, s.bd), jnp.float32))
    out = (acc * inv_t).astype(dh_ref.dtype)
    _store(dh_ref.at[pl.ds(r0, s.bn), pl.ds(0, s.bd)], out, _and(rm, s.d_mask(1)))


def _dw_kernel(t_ref, h_ref, w_ref, g_ref, lse_ref, dw_ref, *, s: _LoopShape):
    inv_t = t_ref[0]

    def columns(c0, width: int) -> None:
        def body(i, acc):
            r0 = i * s.bn
            h, w, rm, cm = _loop_tiles(s, h_ref, w_ref, r0, c0, width)
            g = _load(g_ref.at[pl.ds(r0, s.bn), :], rm)
            lse = _load(lse_ref.at[pl.ds(r0, s.bn), :], rm)
            dz = probs_times_g(masked_logits(h, w, inv_t, cm), g, lse, h.dtype)
            return acc + dot(h, dz, contract=(0, 0))  # h^T dZ: [bd, width]

        acc = lax.fori_loop(0, pl.cdiv(s.n, s.bn), body, jnp.zeros((s.bd, width), jnp.float32))
        out = (acc * inv_t).astype(dw_ref.dtype)
        _store(dw_ref.at[pl.ds(0, s.bd), pl.ds(c0, width)], out,
               _and(s.d_mask(0), s.col_mask(c0, width)))

    j = pl.program_id(0)
    if s.rem:  # the last program owns the remainder tile, at its own static width
        lax.cond(j == s.full_tiles, lambda: columns(s.full_tiles * s.bv, s.rem),
                 lambda: columns(j * s.bv, s.bv))
    else:
        columns(j * s.bv, s.bv)


def _call(kernel, s: _LoopShape, grid: int, out_shape, cfg: KernelConfig, name: str, *args):
    return pl.pallas_call(
        partial(kernel, s=s),
        out_shape=out_shape,
        grid=(grid,),
        # Explicit Triton params: a bare pallas_call on GPU now defaults to Mosaic GPU, which
        # would stage whole-array refs through shared memory.
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=cfg.interpret,
        name=name,
    )(*args)


def forward(h: Array, w: Array, inv_t: Array, cfg: KernelConfig) -> tuple[Array, Array]:
    """(lse, entropy), each [N, 1] float32; ``inv_t`` is 1 / temperature, shape [1]."""
    s = _loop_shape(h, w, cfg)
    col = jax.ShapeDtypeStruct((s.n, 1), jnp.float32)
    return _call(_fwd_kernel, s, pl.cdiv(s.n, s.bn), (col, col), cfg, "linear_lse_fwd",
                 inv_t, h, w)


def backward(
    h: Array, w: Array, inv_t: Array, g: Array, lse: Array, cfg: KernelConfig
) -> tuple[Array, Array]:
    """(dh, dw) of sum(g * lse) for g, lse [N, 1] float32, in the dtypes of h and w."""
    s = _loop_shape(h, w, cfg)
    dh = _call(
        _dh_kernel, s, pl.cdiv(s.n, s.bn), jax.ShapeDtypeStruct(h.shape, h.dtype), cfg,
        "linear_lse_dh", inv_t, h, w, g, lse,
    )
    dw = _call(
        _dw_kernel, s, pl.cdiv(s.v, s.bv), jax.ShapeDtypeStruct(w.shape, w.dtype), cfg,
        "linear_lse_dw", inv_t, h, w, g, lse,
    )
    return dh, dw
