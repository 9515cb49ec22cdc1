"""cuDNN flash attention on packed rows, through ``jax.nn.dot_product_attention``.

Whether cuDNN can honour packed segment ids through the public API (JAX 0.10): the ``cudnn``
path of ``jax.nn.dot_product_attention`` takes ``is_causal`` plus a boolean ``mask`` broadcastable
to ``[B, N, T, S]``, which it turns into an additive bias (``combine_bias_and_mask``) that the
fused kernel adds to the scores. A ``[B, 1, T, T]`` mask of "same segment" therefore gives exactly
the packed-row semantics, GQA included (K/V heads are not repeated). ``query_seq_lengths`` /
``key_value_seq_lengths`` only express one sequence per row (padding at the end), and cuDNN's
packed (THD) layout with per-segment offsets is reachable only through the private
``jax._src.cudnn`` API, so the mask is the supported route. Its cost: the bias is dense, ``B x T x T``
elements per call (8 rows of 4,096: 268 MB in bf16), and cuDNN computes its gradient (dbias)
although nothing uses it; the device check measures whether it still beats ``pallas_gpu``.

Constraints cuDNN adds: bf16/fp16 inputs, head_dim a multiple of 8 (<= 128, or 256 from Hopper),
and an even T when training with a bias (T is padded here; padded keys are segment 0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trainer_jax.models.blocked_attention import visible

Array = jax.Array


def attention_cudnn(q: Array, k: Array, v: Array, segment_ids: Array, *,
                    implementation: str = "cudnn") -> Array:
    """Causal GQA attention with segment ids (``attention.attention``'s contract).

    ``implementation="xla"`` runs the same call through XLA's dense path: how the mask is built
    is tested on a CPU, where cuDNN does not exist.
    """
    t = q.shape[1]
    pad = t % 2  # cuDNN rejects an odd T with a bias in training
    if pad:
        q, k, v = (jnp.pad(x, [(0, 0), (0, pad), (0, 0), (0, 0)]) for x in (q, k, v))
        segment_ids = jnp.pad(segment_ids, [(0, 0), (0, pad)])
    idx = jnp.arange(t + pad)
    # Same rule as ``reference``: causal, same non-zero segment, and every query sees itself (a
    # padding query attends to itself alone, so no softmax row is empty).
    mask = visible(idx[:, None], idx[None, :], segment_ids[:, :, None], segment_ids[:, None, :])
    out = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], is_causal=True,
                                       scale=q.shape[-1] ** -0.5, implementation=implementation)
    return out[:, :t].astype(q.dtype)


__all__ = ["attention_cudnn"]
