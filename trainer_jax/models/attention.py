"""Causal grouped-query attention on packed rows: one API, interchangeable implementations.

``attention(q [B, T, H, hd], k [B, T, K, hd], v [B, T, K, hd], segment_ids [B, T], impl=...)``
returns ``[B, T, H, hd]`` in ``q.dtype``, scaled by ``hd ** -0.5``; query head ``h`` uses K/V head
``h // (H // K)``. Query ``i`` sees key ``j`` when ``j <= i`` and both carry the same non-zero
segment id (``visible``). Segment 0 is padding: the outputs there are finite but otherwise
unspecified (``reference`` and ``blocked`` let a padding query see only itself, the fused kernels
let it see earlier padding), and nothing at a padding position reaches any other segment.
Segments must be contiguous runs along T, which is what packing produces.

Implementations (``IMPLS``; each tested against ``reference``):

- ``reference``: the plain ``[B, H, T, T]`` score matrix. The oracle.
- ``blocked``: flash-style online softmax over key blocks in XLA (``blocked.py``), with a custom
  VJP that recomputes scores block by block, so memory is O(T * block) per head instead of
  O(T^2). Blocks no query of a block can see (above the diagonal, or before the earliest segment
  start in the block) are skipped, so packed rows of short sequences cost little. The ``auto``
  choice on CPU, with blocks of ``CPU_BLOCK``.
- ``pallas_gpu``: the Pallas (Triton) flash attention of ``jax.experimental.pallas.ops.gpu``, with
  segment ids; K/V heads repeated to H.
- ``splash``: TPU splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``) with a
  causal mask and segment ids; native GQA.
- ``cudnn``: cuDNN flash attention through ``jax.nn.dot_product_attention(implementation="cudnn")``
  (``cudnn_attention.py``); segment ids as a boolean mask, native GQA.

``impl=None`` or ``"auto"`` picks per platform (``default_impl``): a fused kernel only where
``scripts/device_check.sh`` compared it with ``reference`` on this device kind and JAX minor and it
passed (``trainer_jax/kernels/checked.py``), else ``blocked``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp

from trainer_jax.kernels import checked
from trainer_jax.models.blocked_attention import attention_blocked, visible
from trainer_jax.models.cudnn_attention import attention_cudnn

Array = jax.Array
AttentionImpl = Literal["auto", "reference", "blocked", "pallas_gpu", "splash", "cudnn"]

# Key/query block of the blocked form when ``auto`` picks it on CPU. Smaller blocks skip more of
# the masked upper triangle; below ~64 the per-block loop overhead wins. On a 2-core x86 host the
# dense reference was never the faster one (``benchmarks/bench_attention.py``, fwd+bwd medians,
# 8 rows, 8 query / 4 K/V heads of 32: at T=256 reference 81 ms vs blocks of 32 / 64 / 128: 42 /
# 37 / 53 ms; at T=1,024, 1,092 ms vs 785 / 531 / 607 ms), and its memory is linear in T as well.
CPU_BLOCK = 64


def default_impl(seq_len: int, platform: str | None = None, *,
                 where: checked.Where | None = None) -> str:
    """The implementation ``auto`` resolves to for rows of ``seq_len`` on ``platform``: the fused
    kernel the device check passed on this device kind and JAX minor (the fastest, if several),
    else ``blocked`` (``checked.choose``; ``where`` overrides the device it asks about).

    Every platform's choice is independent of ``seq_len`` today; the argument stays so that a
    length-dependent choice (a fused kernel with a minimum tile, say) needs no new signature.
    """
    return checked.choose("attention", where or checked.here(platform))[0]


# The platforms a fused kernel compiles for (the others run anywhere XLA does).
KERNEL_PLATFORMS = {"pallas_gpu": ("gpu", "cuda"), "splash": ("tpu",), "cudnn": ("gpu", "cuda")}


def check_platform(impl: str, platform: str | None = None) -> None:
    """Fail early (at setup, not at the first step's trace) when ``impl`` cannot run here."""
    platform = platform or jax.default_backend()
    if impl in KERNEL_PLATFORMS and platform not in KERNEL_PLATFORMS[impl]:
        raise ValueError(f"attention implementation {impl!r} runs on {'/'.join(KERNEL_PLATFORMS[impl])}, "
                         f"not on {platform}; use 'auto' (here: {default_impl(0, platform)!r})")


def attention_reference(q: Array, k: Array, v: Array, segment_ids: Array) -> Array:
    """Plain attention: every score of every head, masked, softmax in fp32."""
    b, t, h, hd = q.shape
    g = h // k.shape[2]
    # Head-major layout: one [T, hd] x [hd, T] matmul per (row, head) batches well on XLA:CPU,
    # unlike the grouped "btkgh,bskh" contraction, which XLA:CPU runs several times slower.
    qh = q.transpose(0, 2, 1, 3)
    kh = jnp.repeat(k, g, axis=2).transpose(0, 2, 1, 3)
    vh = jnp.repeat(v, g, axis=2).transpose(0, 2, 1, 3)
    scores = jnp.einsum("bhtd,bhsd->bhts", qh, kh, preferred_element_type=jnp.float32)
    idx = jnp.arange(t)
    mask = visible(idx[:, None], idx[None, :], segment_ids[:, :, None], segment_ids[:, None, :])
    scores = jnp.where(mask[:, None], scores * (hd ** -0.5), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhts,bhsd->bhtd", probs, vh, preferred_element_type=jnp.float32)
    return out.transpose(0, 2, 1, 3).astype(q.dtype)


def _pad_time(x: Array, multiple: int) -> Array:
    pad = -x.shape[1] % multiple
    return x if pad == 0 else jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))


def attention_pallas_gpu(q: Array, k: Array, v: Array, segment_ids: Array, *,
                         interpret: bool = False, block: int = 128,
                         backward_block: int = 32) -> Array:
    """Pallas flash attention for GPUs (Triton); ``interpret=True`` runs it on CPU for tests.

    ``block`` tiles the forward, ``backward_block`` the two backward kernels: the kernel's own
    defaults (128 / 32), since a backward tile holds q, k, v, dO and dQ/dK/dV blocks at once and
    128-row tiles of 128-wide heads overflow the shared memory Triton may use.
    """
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    b, t, h, hd = q.shape
    g = h // k.shape[2]
    block = min(block, 1 << max(t - 1, 0).bit_length())  # a power of two, as Triton needs
    bwd = min(backward_block, block)  # divides block: both are powers of two
    sizes = pallas_attention.BlockSizes(block_q=block, block_k=block, block_q_dkv=bwd,
                                        block_kv_dkv=bwd, block_q_dq=bwd, block_kv_dq=bwd)
    # Padded positions get segment 0: the kernel lets them see only other padding.
    out = pallas_attention.mha(
        _pad_time(q, block), _pad_time(jnp.repeat(k, g, axis=2), block),
        _pad_time(jnp.repeat(v, g, axis=2), block), _pad_time(segment_ids, block),
        sm_scale=hd ** -0.5, causal=True, block_sizes=sizes, interpret=interpret)
    return out[:, :t]


def attention_splash(q: Array, k: Array, v: Array, segment_ids: Array, *,
                     interpret: bool = False, block: int = 128) -> Array:
    """TPU splash attention with a causal mask and segment ids, vmapped over rows."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as splash_mask,
    )

    b, t, h, hd = q.shape
    tp = t + (-t % block)
    mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((tp, tp)) for _ in range(h)])
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                              block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                              block_q_dq=block, block_kv_dq=block)
    kernel = splash.make_splash_mha_single_device(mask, block_sizes=sizes, interpret=interpret)
    # Splash takes no softmax scale: fold it into q. Layout per row: [heads, T, hd].
    qs = _pad_time(q * jnp.asarray(hd ** -0.5, q.dtype), block).transpose(0, 2, 1, 3)
    ks = _pad_time(k, block).transpose(0, 2, 1, 3)
    vs = _pad_time(v, block).transpose(0, 2, 1, 3)
    seg = _pad_time(segment_ids, block)

    def one_row(qr, kr, vr, sr):
        return kernel(qr, kr, vr, segment_ids=splash.SegmentIds(q=sr, kv=sr))

    out = jax.vmap(one_row)(qs, ks, vs, seg)
    return out.transpose(0, 2, 1, 3)[:, :t].astype(q.dtype)


IMPLS: dict[str, Callable[..., Array]] = {
    "reference": attention_reference,
    "blocked": attention_blocked,
    "pallas_gpu": attention_pallas_gpu,
    "splash": attention_splash,
    "cudnn": attention_cudnn,
}


def attention(q: Array, k: Array, v: Array, segment_ids: Array, *, impl: str | None = None,
              **options) -> Array:
    """Causal GQA attention on packed rows (module docstring); ``options`` go to the impl."""
    if q.ndim != 4 or k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"expected q [B,T,H,hd], k = v [B,T,K,hd]; got {q.shape}, {k.shape}, "
                         f"{v.shape}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{q.shape[2]} query heads are not a multiple of {k.shape[2]} K/V heads")
    if segment_ids.shape != q.shape[:2]:
        raise ValueError(f"segment_ids {segment_ids.shape} must be [B, T] = {q.shape[:2]}")
    if impl is None or impl == "auto":
        impl = default_impl(q.shape[1])
        if impl == "blocked":
            options = {"block": CPU_BLOCK, **options}
    if impl not in IMPLS:
        raise ValueError(f"attention impl {impl!r}: expected 'auto' or one of {sorted(IMPLS)}")
    return IMPLS[impl](q, k, v, jnp.asarray(segment_ids, jnp.int32), **options)


__all__ = ["CPU_BLOCK", "IMPLS", "KERNEL_PLATFORMS", "AttentionImpl", "attention",
           "attention_reference", "check_platform", "default_impl", "visible"]
