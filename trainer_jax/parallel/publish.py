"""Weight publication from sharded parameters: each tensor gathered once, written by one process.

``iter_gathered_hf_tensors(model)`` walks the model's HF tensor table (``models.hf_params``),
grouped by parameter, so a stacked MoE expert array ``[E, ...]`` is gathered once and sliced
into its E HF tensors on the host. With several processes the gather is a collective: *every*
process must run the iterator to the end, in the same order; ``publish_sharded`` does that and
lets one process (``writer``) hand the tensors to ``convert.publish`` while the others discard
them. Host memory holds one gathered parameter at a time (one layer's experts for MoE).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from trainer_jax.models.hf_params import ParamSlot, param_map


def gather_to_host(x: jax.Array, dtype: Any = None) -> np.ndarray:
    """The whole of a (possibly sharded, possibly multi-process) array as a host numpy array.

    ``dtype``: cast on the devices first (a bf16 publish moves half the bytes). With several
    processes this is a collective every process must call.
    """
    if dtype is not None and x.dtype != dtype:
        x = jax.jit(lambda y: y.astype(dtype), out_shardings=x.sharding)(x)
    if x.is_fully_addressable:
        return np.asarray(x)  # assembled on the host from the local shards, no device copy
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _grouped(model: nnx.Module) -> list[tuple[nnx.Variable, list[tuple[str, ParamSlot]]]]:
    groups: dict[int, tuple[nnx.Variable, list[tuple[str, ParamSlot]]]] = {}
    for name, slot in param_map(model).items():
        groups.setdefault(id(slot.param), (slot.param, []))[1].append((name, slot))
    return list(groups.values())


def iter_gathered_hf_tensors(model: nnx.Module, dtype: Any = None, *,
                             on_gather: Any = None) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(hf_name, array)`` in HF layout (``[out, in]``) from a sharded model.

    Equals ``models.iter_hf_tensors(model, dtype)`` up to the order of names. ``on_gather(path,
    nbytes)`` is called once per gathered parameter (tests count gathers with it).
    """
    for param, slots in _grouped(model):
        host = gather_to_host(param.get_value(), dtype)
        if on_gather is not None:
            on_gather(slots[0][0], host.nbytes)
        for name, slot in slots:
            value = host if slot.expert is None else host[slot.expert]
            yield name, np.ascontiguousarray(value.T if slot.transpose else value)
        del host


def publish_sharded(model: nnx.Module, config: Any, out_root: str | os.PathLike, version: int,
                    formats: Iterable[str] = ("bf16",), *, writer: int = 0,
                    dtype: Any = None, **publish_kwargs: Any) -> dict[str, Path] | None:
    """``convert.publish`` from a sharded model; call it on every process.

    Process ``writer`` writes (atomically, as ``publish`` always does) and gets ``{format:
    path}``; the others take part in the gathers and get ``None``. If the writer fails, every
    process raises ``RuntimeError`` after the gathers complete (no process is left waiting in
    a collective). ``dtype``: cast before gathering, e.g. ``jnp.bfloat16`` when only bf16-based
    formats are published.
    """
    from convert.publish import publish

    tensors = iter_gathered_hf_tensors(model, dtype)
    result: dict[str, Path] | None = None
    error: BaseException | None = None
    if jax.process_index() == writer:
        try:
            result = publish(tensors, config, out_root, version, formats, **publish_kwargs)
        except Exception as e:  # noqa: BLE001 - reported to every process below
            error = e
    for _ in tensors:  # the rest of the collectives (all of them on non-writers)
        pass
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        failed = multihost_utils.broadcast_one_to_all(np.int32(error is not None),
                                                      is_source=jax.process_index() == writer)
        if int(failed) and error is None:
            raise RuntimeError(f"publishing version {version} failed on process {writer}")
    if error is not None:
        raise error
    return result
