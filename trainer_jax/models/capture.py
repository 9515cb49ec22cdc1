"""Activation maxima recorded while a forward pass is traced, for scale calibration.

The model calls ``amax`` / ``grouped_amax`` at the points a quantized serving kernel would scale
a tensor (each projection's input, the cached K and V). Outside ``recording()`` both return at
once, before touching the array: the normal forward's traces, and so its compiled programs, are
unchanged. Inside ``recording()`` (entered *within* the function being traced, like
``trainer_jax.parallel.hooks``), each call appends ``(name, max |x|)`` to the record list, in
call order, as float32 values of the trace; the traced function returns them
(``trainer_jax.calibration``). Names are relative to a decoder layer; the caller attributes
records to layers by order (every layer starts with ``self_attn.qkv``). The values are tracers
of the enclosing trace, so the recorded forward must not run layers under a transform of its
own (``remat``, ``scan``): the calibration forward turns remat off.

This module imports nothing from the project (the model imports it).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp

Record = list[tuple[str, jax.Array]]

_ACTIVE: contextvars.ContextVar[Record | None] = contextvars.ContextVar("mixrl_capture",
                                                                        default=None)


def amax(name: str, x: jax.Array) -> None:
    """Record ``max |x|`` (a float32 scalar) as ``name`` while recording; else nothing."""
    record = _ACTIVE.get()
    if record is not None:
        record.append((name, jnp.max(jnp.abs(x)).astype(jnp.float32)))


def grouped_amax(name: str, rows: jax.Array, group_sizes: jax.Array) -> None:
    """Record the per-group ``max |row|`` (float32 ``[G]``) of ``rows [N, D]`` sorted by group,
    ``group_sizes[g]`` rows each (MoE experts); an empty group records 0."""
    record = _ACTIVE.get()
    if record is None:
        return
    n_groups = group_sizes.shape[0]
    group_of_row = jnp.repeat(jnp.arange(n_groups), group_sizes, total_repeat_length=rows.shape[0])
    per_row = jnp.max(jnp.abs(rows), axis=-1).astype(jnp.float32)
    # Rows past sum(group_sizes) (none in the model's dispatch) fall in the last group: drop them.
    valid = jnp.arange(rows.shape[0]) < jnp.sum(group_sizes)
    per_group = jax.ops.segment_max(jnp.where(valid, per_row, 0.0), group_of_row,
                                    num_segments=n_groups)
    record.append((name, jnp.maximum(per_group, 0.0)))  # segment_max of nothing is -inf


@contextlib.contextmanager
def recording() -> Iterator[Record]:
    """Collect the maxima of the forward traced inside this block (in this thread only)."""
    record: Record = []
    token = _ACTIVE.set(record)
    try:
        yield record
    finally:
        _ACTIVE.reset(token)


__all__ = ["amax", "grouped_amax", "recording"]
