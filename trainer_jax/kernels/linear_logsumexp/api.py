"""Public entry point: one API, interchangeable implementations.

``linear_logsumexp(h, w, temperature=T, impl=...)`` returns, for z = h w / T,

    lse[n]     = logsumexp_v z[n, v]                     (differentiable in h and w)
    entropy[n] = lse[n] - sum_v softmax(z[n])_v z[n, v]  (diagnostic, stop-gradient)

both float32 whatever the input dtype. ``IMPLS`` maps the implementation names (defined once,
in ``names``) to functions ``fn(h, w, temperature, **options) -> (lse, entropy)``; every entry
is tested against ``reference``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from trainer_jax.kernels.linear_logsumexp.names import IMPL_NAMES, ImplName, resolve_impl
from trainer_jax.kernels.linear_logsumexp.pallas import linear_logsumexp_pallas
from trainer_jax.kernels.linear_logsumexp.reference import linear_logsumexp_reference
from trainer_jax.kernels.linear_logsumexp.xla import linear_logsumexp_xla

Array = jax.Array
ImplFn = Callable[..., tuple[Array, Array]]

IMPLS: dict[ImplName, ImplFn] = {
    "reference": linear_logsumexp_reference,
    "xla": linear_logsumexp_xla,
    "pallas": linear_logsumexp_pallas,
}
# A name in ``ImplName`` without a function here (or the reverse) would pass config validation
# and fail only at the first call: fail at import instead.
if tuple(IMPLS) != IMPL_NAMES:
    raise RuntimeError(f"IMPLS {tuple(IMPLS)} does not match names.ImplName {IMPL_NAMES}")

_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _impl_options(fn: ImplFn) -> set[str]:
    params = inspect.signature(fn).parameters.values()
    return {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _validate(h: Any, w: Any, temperature: Any, impl: str, options: dict[str, Any]) -> None:
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; expected one of {sorted(IMPLS)}")
    for name, x, dims in (("h", h, "[N, D]"), ("w", w, "[D, V]")):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"{name} must be an array of shape {dims}, got {type(x).__name__}")
        if x.ndim != 2:
            raise ValueError(f"{name} must be rank 2 {dims}, got shape {tuple(x.shape)}")
        if not any(x.dtype == d for d in _FLOAT_DTYPES):
            raise ValueError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    if h.shape[1] != w.shape[0]:
        raise ValueError(
            f"hidden size mismatch: h is {tuple(h.shape)} (D={h.shape[1]}) but w is "
            f"{tuple(w.shape)} (D={w.shape[0]})"
        )
    if h.dtype != w.dtype:
        raise ValueError(
            f"h and w must share a dtype, got h {h.dtype} and w {w.dtype}; cast one explicitly"
        )
    if w.shape[1] == 0:
        raise ValueError("w has an empty vocabulary (V=0); logsumexp is undefined")
    if isinstance(temperature, (int, float)):
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    elif jnp.size(temperature) != 1:
        raise ValueError(
            f"temperature must be a scalar, got shape {tuple(jnp.shape(temperature))}"
        )
    unknown = set(options) - _impl_options(IMPLS[impl])
    if unknown:
        raise ValueError(
            f"impl {impl!r} does not take option(s) {sorted(unknown)}; "
            f"it takes {sorted(_impl_options(IMPLS[impl]))}"
        )


def linear_logsumexp(
    h: Array,
    w: Array,
    *,
    temperature: float | Array = 1.0,
    impl: str = "xla",
    **options: Any,
) -> tuple[Array, Array]:
    """Fused ``logsumexp(h @ w / temperature, axis=-1)`` and softmax entropy, float32 [N] each.

    Args:
      h: [N, D] hidden states (float32 / bfloat16 / float16).
      w: [D, V] output projection, same dtype as ``h``.
      temperature: Python float or traced scalar; never differentiated.
      impl: a key of ``IMPLS``: ``"reference"`` (full logits), ``"xla"`` (streaming, the CPU
        default) or ``"pallas"`` (Pallas kernels; interpreted on CPU); or ``"auto"``, the one
        ``names.AUTO_IMPL`` gives this platform.
      **options: implementation options, e.g. ``block_v`` for ``xla``; ``blocks`` (a
        ``BlockSizes``), ``block_n``, ``block_v``, ``layout``, ``interpret`` for ``pallas``.

    Returns:
      (lse, entropy). Gradients reach ``h`` and ``w`` through ``lse``; ``entropy`` is
      stop-gradient.

    Raises:
      ValueError: on an unknown ``impl`` or option, non-2-D inputs, mismatched hidden sizes,
        mixed or non-float dtypes, an empty vocabulary, or a non-positive temperature.
    """
    impl = resolve_impl(impl)
    _validate(h, w, temperature, impl, options)
    if h.shape[0] == 0:
        empty = jnp.zeros((0,), jnp.float32)
        return empty, empty
    temperature = jnp.reshape(jnp.asarray(temperature, jnp.float32), ())
    return IMPLS[impl](h, w, temperature, **options)
