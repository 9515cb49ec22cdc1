"""Pallas kernels for the linear-log-sum-exp (forward, dh, dw), wrapped in a custom_vjp.

Math (z = h w / T, p = softmax(z), g = d loss / d lse):

    forward  lse = m + log s, entropy = log s - a / s     (online accumulators, see ``_online``)
    backward dZ = g p,  dh = dZ w^T / T,  dw = h^T dZ / T   (logits recomputed tile by tile)

Three ``pallas_call``s, none of which forms [N, V]:

* forward: one program per token block, looping over vocabulary tiles with the online lse;
* dh:      one program per token block, looping over vocabulary tiles (recompute z, dZ, dh += ...);
* dw:      one program per vocabulary tile, looping over token blocks (recompute z, dZ, dw += ...).

Two layouts of the same loops, because GPUs and TPUs disagree about where a loop may live:

``"loop"`` (GPU / Triton, and the CPU interpreter): the grid is only over the outer axis and the
inner loop is a ``fori_loop`` inside the kernel, reading tiles of whole-array refs (global memory
on GPU) with *masked* loads. Masks cover the ragged last token block and vocabulary tile and a
hidden size D that is not a power of two (Triton tiles must be), so nothing is padded in HBM.
Accumulators (running max/sum, dh rows, dw columns) live in registers and each output block is
stored once, masked, by the one program that owns it: no read-modify-write, no atomics.

``"grid"`` (TPU / Mosaic): the inner loop is the last, sequential ("arbitrary") grid axis, so
Pallas pipelines the HBM->VMEM copies of the tiles; accumulators live in VMEM scratch and the
output block is written on the last inner step. Ragged edge blocks are padded by Pallas with
undefined values, so the kernels mask them explicitly (logits -> -inf-like, operands -> 0).
Blocks obey TPU tiling: token block a multiple of 8 (or all of N), vocab tile a multiple of
128 (or all of V).

bf16 inputs feed the matmuls directly with fp32 accumulation; dZ is cast to the input dtype
for the two backward matmuls (as in flash attention). f32 inputs use full-precision matmuls.
On CPU the kernels run with ``interpret=True`` (chosen automatically).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from trainer_jax.kernels.linear_logsumexp import _online

Array = jax.Array

# Defaults per layout: (token block, vocabulary tile). Untuned on real hardware (none was
# available); chosen to fit registers/shared memory for D ~ 1-4k on GPU and VMEM on TPU.
_DEFAULT_BLOCKS = {"loop": (32, 64), "grid": (256, 512)}
# In the CPU interpreter every tile is a separate XLA step: bigger tiles amortise that (measured
# ~3x faster than (32, 64) at N=2048, D=1024, V=32k; temp memory stays ~30 MiB).
_DEFAULT_BLOCKS_INTERPRET = {"loop": (512, 2048), "grid": (256, 512)}
LAYOUTS = ("loop", "grid")


@dataclasses.dataclass(frozen=True)
class _Config:
    layout: str
    block_n: int
    block_v: int
    interpret: bool


# --------------------------------------------------------------------------- shared tile math


def _dot(a: Array, b: Array, contract: tuple[int, int] = (1, 0)) -> Array:
    """fp32-accumulating matmul contracting a's axis contract[0] with b's axis contract[1]."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _iota(shape: tuple[int, int], axis: int) -> Array:
    return lax.broadcasted_iota(jnp.int32, shape, axis)


def _and(*masks: Array | None) -> Array | None:
    out = None
    for m in masks:
        if m is not None:
            out = m if out is None else out & m
    return out


def _probs_times_g(z: Array, g: Array, lse: Array, dtype: jnp.dtype) -> Array:
    # Masked logits are NEG, so their exp underflows to exactly 0: no extra select needed.
    return (g * jnp.exp(z - lse)).astype(dtype)


# --------------------------------------------------------------------------- "loop" layout


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
        return (r0 + _iota((self.bn, 1), 0)) < self.n if self.n % self.bn else None

    def col_mask(self, c0: Array, width: int) -> Array | None:
        if self.split_v or not self.v % self.bv:
            return None
        return (c0 + _iota((1, width), 1)) < self.v

    def d_mask(self, axis: int) -> Array | None:
        if self.bd == self.d:
            return None
        shape = (1, self.bd) if axis == 1 else (self.bd, 1)
        return _iota(shape, axis) < self.d


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


def _masked_logits(h: Array, w: Array, inv_t: Array, cm: Array | None) -> Array:
    z = _dot(h, w) * inv_t
    return z if cm is None else jnp.where(cm, z, _online.NEG)


def _fwd_loop_kernel(t_ref, h_ref, w_ref, lse_ref, ent_ref, *, s: _LoopShape):
    r0 = pl.program_id(0) * s.bn
    inv_t = t_ref[0]

    def tile(carry, c0, width):
        h, w, _, cm = _loop_tiles(s, h_ref, w_ref, r0, c0, width)
        return _online.online_update(carry, _masked_logits(h, w, inv_t, cm))

    lse, ent = _online.finalize(_sweep_vocab(s, tile, _online.init_carry(s.bn)))
    rm = s.row_mask(r0)
    _store(lse_ref.at[pl.ds(r0, s.bn), :], lse, rm)
    _store(ent_ref.at[pl.ds(r0, s.bn), :], ent, rm)


def _dh_loop_kernel(t_ref, h_ref, w_ref, g_ref, lse_ref, dh_ref, *, s: _LoopShape):
    r0 = pl.program_id(0) * s.bn
    inv_t = t_ref[0]
    rm = s.row_mask(r0)
    g = _load(g_ref.at[pl.ds(r0, s.bn), :], rm)  # ragged rows: g = 0, so dZ = 0
    lse = _load(lse_ref.at[pl.ds(r0, s.bn), :], rm)

    def tile(acc, c0, width):
        h, w, _, cm = _loop_tiles(s, h_ref, w_ref, r0, c0, width)
        dz = _probs_times_g(_masked_logits(h, w, inv_t, cm), g, lse, w.dtype)
        return acc + _dot(dz, w, contract=(1, 1))  # dZ w^T: [bn, bd]

    acc = _sweep_vocab(s, tile, jnp.zeros((s.bn, s.bd), jnp.float32))
    out = (acc * inv_t).astype(dh_ref.dtype)
    _store(dh_ref.at[pl.ds(r0, s.bn), pl.ds(0, s.bd)], out, _and(rm, s.d_mask(1)))


def _dw_loop_kernel(t_ref, h_ref, w_ref, g_ref, lse_ref, dw_ref, *, s: _LoopShape):
    inv_t = t_ref[0]

    def columns(c0, width: int) -> None:
        def body(i, acc):
            r0 = i * s.bn
            h, w, rm, cm = _loop_tiles(s, h_ref, w_ref, r0, c0, width)
            g = _load(g_ref.at[pl.ds(r0, s.bn), :], rm)
            lse = _load(lse_ref.at[pl.ds(r0, s.bn), :], rm)
            dz = _probs_times_g(_masked_logits(h, w, inv_t, cm), g, lse, h.dtype)
            return acc + _dot(h, dz, contract=(0, 0))  # h^T dZ: [bd, width]

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


def _loop_shape(h: Array, w: Array, cfg: _Config) -> _LoopShape:
    n, d = h.shape
    v = w.shape[1]
    # Power-of-two tiles (Triton), at least 16 (tl.dot), no larger than needed.
    bn = max(16, min(cfg.block_n, pl.next_power_of_2(n)))
    bv = max(16, min(cfg.block_v, pl.next_power_of_2(v)))
    # The interpreter takes any D and tile width; rounding up there would pad h and w.
    bd = d if cfg.interpret else max(16, pl.next_power_of_2(d))
    if cfg.interpret:
        bv = min(cfg.block_v, v)
    return _LoopShape(n=n, d=d, v=v, bn=bn, bd=bd, bv=bv, split_v=cfg.interpret)


def _call_loop(kernel, s: _LoopShape, grid: int, out_shape, cfg: _Config, name: str, *args):
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


# --------------------------------------------------------------------------- "grid" layout


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
        return (i * self.bn + _iota((self.bn, 1), 0)) < self.n if self.n % self.bn else None

    def col_mask(self, j: Array) -> Array | None:
        return (j * self.bv + _iota((1, self.bv), 1)) < self.v if self.v % self.bv else None


def _grid_shape(h: Array, w: Array, cfg: _Config) -> _GridShape:
    n, d = h.shape
    v = w.shape[1]
    bn = n if n <= cfg.block_n else cfg.block_n
    bv = v if v <= cfg.block_v else cfg.block_v
    if bn != n and bn % 8:
        raise ValueError(f"grid layout: block_n must be a multiple of 8, got {bn}")
    if bv != v and bv % 128:
        raise ValueError(f"grid layout: block_v must be a multiple of 128, got {bv}")
    return _GridShape(n=n, d=d, v=v, bn=bn, bv=bv)


def _fwd_grid_kernel(t_ref, h_ref, w_ref, lse_ref, ent_ref, m_sc, s_sc, a_sc, *, s: _GridShape):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        m_sc[...], s_sc[...], a_sc[...] = _online.init_carry(s.bn)

    z = _masked_logits(h_ref[...], w_ref[...], t_ref[0], s.col_mask(j))
    m_sc[...], s_sc[...], a_sc[...] = _online.online_update((m_sc[...], s_sc[...], a_sc[...]), z)

    @pl.when(j == s.nv - 1)
    def _finish():
        lse_ref[...], ent_ref[...] = _online.finalize((m_sc[...], s_sc[...], a_sc[...]))


def _dh_grid_kernel(t_ref, h_ref, w_ref, g_ref, lse_ref, dh_ref, acc_sc, *, s: _GridShape):
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
    dz = _probs_times_g(_masked_logits(h_ref[...], w, inv_t, cm), g_ref[...], lse_ref[...],
                        w.dtype)
    acc_sc[...] += _dot(dz, w, contract=(1, 1))

    @pl.when(j == s.nv - 1)
    def _finish():
        dh_ref[...] = (acc_sc[...] * inv_t).astype(dh_ref.dtype)


def _dw_grid_kernel(t_ref, h_ref, w_ref, g_ref, lse_ref, dw_ref, acc_sc, *, s: _GridShape):
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
    dz = _probs_times_g(_masked_logits(h, w_ref[...], inv_t, s.col_mask(j)), g, lse, h.dtype)
    acc_sc[...] += _dot(h, dz, contract=(0, 0))

    @pl.when(i == s.nb - 1)
    def _finish():
        dw_ref[...] = (acc_sc[...] * inv_t).astype(dw_ref.dtype)


def _tpu_params() -> pltpu.CompilerParams:
    # Outer axis independent (megacore may split it); inner axis carries the accumulators.
    return pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))


_SCALAR_SPEC = pl.BlockSpec(memory_space=pltpu.SMEM)


def _grid_forward(h: Array, w: Array, inv_t: Array, cfg: _Config) -> tuple[Array, Array]:
    s = _grid_shape(h, w, cfg)
    col = jax.ShapeDtypeStruct((s.n, 1), jnp.float32)
    rows = pl.BlockSpec((s.bn, 1), lambda i, j: (i, 0))
    return pl.pallas_call(
        partial(_fwd_grid_kernel, s=s),
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


def _grid_backward(h, w, inv_t, g, lse, cfg: _Config) -> tuple[Array, Array]:
    s = _grid_shape(h, w, cfg)
    dh = pl.pallas_call(
        partial(_dh_grid_kernel, s=s),
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
        partial(_dw_grid_kernel, s=s),
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


# --------------------------------------------------------------------------- dispatch + vjp


def _forward(h: Array, w: Array, inv_t: Array, cfg: _Config) -> tuple[Array, Array]:
    """(lse, entropy), each [N, 1] float32."""
    if cfg.layout == "grid":
        return _grid_forward(h, w, inv_t, cfg)
    s = _loop_shape(h, w, cfg)
    col = jax.ShapeDtypeStruct((s.n, 1), jnp.float32)
    return _call_loop(
        _fwd_loop_kernel, s, pl.cdiv(s.n, s.bn), (col, col), cfg, "linear_lse_fwd", inv_t, h, w
    )


def _backward(h, w, inv_t, g, lse, cfg: _Config) -> tuple[Array, Array]:
    if cfg.layout == "grid":
        return _grid_backward(h, w, inv_t, g, lse, cfg)
    s = _loop_shape(h, w, cfg)
    dh = _call_loop(
        _dh_loop_kernel, s, pl.cdiv(s.n, s.bn), jax.ShapeDtypeStruct(h.shape, h.dtype), cfg,
        "linear_lse_dh", inv_t, h, w, g, lse,
    )
    dw = _call_loop(
        _dw_loop_kernel, s, pl.cdiv(s.v, s.bv), jax.ShapeDtypeStruct(w.shape, w.dtype), cfg,
        "linear_lse_dw", inv_t, h, w, g, lse,
    )
    return dh, dw


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _lse_pallas(h: Array, w: Array, inv_t: Array, cfg: _Config) -> tuple[Array, Array]:
    return _forward(h, w, inv_t, cfg)


def _fwd(h, w, inv_t, cfg):
    lse, ent = _forward(h, w, inv_t, cfg)
    return (lse, ent), (h, w, inv_t, lse)


def _bwd(cfg: _Config, res, cts):
    h, w, inv_t, lse = res
    g, _ = cts  # the entropy is a diagnostic: its cotangent is ignored
    dh, dw = _backward(h, w, inv_t, g.astype(jnp.float32), lse, cfg)
    return dh, dw, jnp.zeros_like(inv_t)


_lse_pallas.defvjp(_fwd, _bwd)


def default_layout() -> str:
    """``"grid"`` on TPU (pipelined inner grid axis), ``"loop"`` elsewhere (Triton, CPU)."""
    return "grid" if jax.default_backend() == "tpu" else "loop"


def linear_logsumexp_pallas(
    h: Array,
    w: Array,
    temperature: Array,
    *,
    block_n: int | None = None,
    block_v: int | None = None,
    layout: str | None = None,
    interpret: bool | None = None,
) -> tuple[Array, Array]:
    """(lse [N], entropy [N]) float32 for z = h w / temperature via Pallas kernels.

    Args:
      block_n, block_v: token block and vocabulary tile (defaults per layout).
      layout: ``"loop"`` (GPU/Triton) or ``"grid"`` (TPU/Mosaic); default by backend.
      interpret: run the kernels in the Pallas interpreter; default True on CPU.
    """
    layout = default_layout() if layout is None else layout
    if layout not in LAYOUTS:
        raise ValueError(f"unknown pallas layout {layout!r}; expected one of {LAYOUTS}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    dn, dv = (_DEFAULT_BLOCKS_INTERPRET if interpret else _DEFAULT_BLOCKS)[layout]
    block_n = dn if block_n is None else int(block_n)
    block_v = dv if block_v is None else int(block_v)
    if block_n < 1 or block_v < 1:
        raise ValueError(f"block sizes must be positive, got block_n={block_n}, block_v={block_v}")
    cfg = _Config(layout=layout, block_n=block_n, block_v=block_v, interpret=bool(interpret))
    inv_t = lax.stop_gradient(1.0 / jnp.reshape(jnp.asarray(temperature, jnp.float32), (1,)))
    lse, ent = _lse_pallas(h, w, inv_t, cfg)
    return lse[:, 0], lax.stop_gradient(ent[:, 0])
