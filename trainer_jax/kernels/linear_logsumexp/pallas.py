"""Pallas linear-log-sum-exp: picks a layout per platform and wraps it in a custom_vjp.

Three ``pallas_call``s, none of which forms [N, V]: forward and dh (one program per token block,
looping over vocabulary tiles) and dw (one program per vocabulary tile, looping over token
blocks). GPUs and TPUs disagree about where that loop may live, hence two layouts:

* ``"loop"`` (``pallas_gpu``): Triton, and the CPU interpreter; ``fori_loop`` inside the kernel.
* ``"grid"`` (``pallas_tpu``): Mosaic; the loop is the sequential last grid axis.

Shared tile math and ``BlockSizes`` are in ``pallas_common``. On CPU the kernels run with
``interpret=True`` (chosen automatically).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from trainer_jax.kernels.linear_logsumexp import pallas_gpu, pallas_tpu
from trainer_jax.kernels.linear_logsumexp.pallas_common import BlockSizes, KernelConfig

Array = jax.Array

# Each layout module provides default_blocks(interpret), forward(...) and backward(...).
_LAYOUTS = {"loop": pallas_gpu, "grid": pallas_tpu}
LAYOUTS = tuple(_LAYOUTS)


def default_layout() -> str:
    """``"grid"`` on TPU (pipelined inner grid axis), ``"loop"`` elsewhere (Triton, CPU)."""
    return "grid" if jax.default_backend() == "tpu" else "loop"


def default_blocks(layout: str, interpret: bool) -> BlockSizes:
    """The tiles ``layout`` uses when none are given (the interpreter's differ on ``"loop"``)."""
    return _LAYOUTS[layout].default_blocks(interpret)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _lse_pallas(h: Array, w: Array, inv_t: Array, cfg: KernelConfig) -> tuple[Array, Array]:
    return _LAYOUTS[cfg.layout].forward(h, w, inv_t, cfg)


def _fwd(h, w, inv_t, cfg):
    lse, ent = _LAYOUTS[cfg.layout].forward(h, w, inv_t, cfg)
    return (lse, ent), (h, w, inv_t, lse)


def _bwd(cfg: KernelConfig, res, cts):
    h, w, inv_t, lse = res
    g, _ = cts  # the entropy is a diagnostic: its cotangent is ignored
    dh, dw = _LAYOUTS[cfg.layout].backward(h, w, inv_t, g.astype(jnp.float32), lse, cfg)
    return dh, dw, jnp.zeros_like(inv_t)


_lse_pallas.defvjp(_fwd, _bwd)


def linear_logsumexp_pallas(
    h: Array,
    w: Array,
    temperature: Array,
    *,
    blocks: BlockSizes | None = None,
    block_n: int | None = None,
    block_v: int | None = None,
    layout: str | None = None,
    interpret: bool | None = None,
) -> tuple[Array, Array]:
    """(lse [N], entropy [N]) float32 for z = h w / temperature via Pallas kernels.

    Args:
      blocks: token block and vocabulary tile (default: the layout's, see ``default_blocks``).
      block_n, block_v: override one size of ``blocks`` (the scalar form configs pass).
      layout: ``"loop"`` (GPU/Triton) or ``"grid"`` (TPU/Mosaic); default by backend.
      interpret: run the kernels in the Pallas interpreter; default True on CPU.
    """
    layout = default_layout() if layout is None else layout
    if layout not in LAYOUTS:
        raise ValueError(f"unknown pallas layout {layout!r}; expected one of {LAYOUTS}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if blocks is None:
        blocks = default_blocks(layout, bool(interpret))
    elif not isinstance(blocks, BlockSizes):
        raise ValueError(f"blocks must be a BlockSizes, got {type(blocks).__name__}")
    blocks = blocks.replace(block_n=block_n, block_v=block_v)
    cfg = KernelConfig(layout=layout, blocks=blocks, interpret=bool(interpret))
    inv_t = lax.stop_gradient(1.0 / jnp.reshape(jnp.asarray(temperature, jnp.float32), (1,)))
    lse, ent = _lse_pallas(h, w, inv_t, cfg)
    return lse[:, 0], lax.stop_gradient(ent[:, 0])
