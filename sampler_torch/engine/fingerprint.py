"""A fingerprint of the weights an engine serves, computed where they live.

What the version probe's first check compares before and after a reload: if the export's files
changed but this did not, the reload did nothing (``mixrl_wire.probe.NOOP_RELOAD``). Hashing the
bytes on the host would copy every weight off the GPU at each reload; instead each tensor's bits,
read as integers, are summed with position weights on its own device (a changed element moves the
sum unless another change cancels it exactly at the same weighted total) and the per-tensor sums,
names, shapes and dtypes are hashed on the host.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

_CHUNK = 1 << 22
_MODULUS = 65521  # position weights cycle through 1..65521 (a prime: no alignment with shapes)

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_int(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as the integers of their size that ``tensor_sum`` weighs (a view)."""
    if t.dtype.is_floating_point or t.dtype.is_complex or t.element_size() in _INT_VIEW:
        return t.view(_INT_VIEW[t.element_size()])
    return t


def tensor_sum(t: torch.Tensor) -> int:
    """Position-weighted sum of ``t``'s bits (as integers of its element size), on its device:
    ``sum_i int(t_i) * (i mod 65521 + 1)`` in wrapping int64 arithmetic."""
    flat = as_int(t.detach().contiguous().reshape(-1))
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), _CHUNK):
        part = flat[start:start + _CHUNK].to(torch.int64)
        w = torch.arange(start, start + part.numel(), device=flat.device, dtype=torch.int64)
        total += (part * (w % _MODULUS + 1)).sum()  # int64 wraps on overflow: still a fingerprint
    return int(total)


def sum_change(idx: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> int:
    """How ``tensor_sum`` of a tensor moves when its (flat) elements ``idx`` go from ``old`` to
    ``new`` (``as_int`` values): the sum is linear in the elements, so
    ``sum_i (new_i - old_i) * (idx_i mod 65521 + 1)``, wrapping like the sum itself. An in-place
    reload keeps the fingerprint exact from the changed elements alone."""
    w = idx.to(torch.int64) % _MODULUS + 1
    return int(((new.to(torch.int64) - old.to(torch.int64)) * w).sum())


def wrap64(x: int) -> int:
    """``x`` as the signed 64-bit integer int64 arithmetic wraps it to."""
    return (x + (1 << 63)) % (1 << 64) - (1 << 63)


def digest_of(sums: Iterable[tuple[str, tuple, torch.dtype, int]], extra: object = None) -> str:
    """sha256 over ``(name, shape, dtype, tensor_sum)`` of every tensor (sorted by name), plus
    ``repr(extra)``: ``fingerprint`` from sums already taken."""
    h = hashlib.sha256()
    for name, shape, dtype, total in sorted(sums, key=lambda e: e[0]):
        h.update(f"{name}|{tuple(shape)}|{dtype}|{total}\n".encode())
    h.update(repr(extra).encode())
    return h.hexdigest()


def fingerprint(named: Iterable[tuple[str, torch.Tensor]], extra: object = None) -> str:
    """sha256 over ``(name, shape, dtype, tensor_sum)`` of every tensor, plus ``repr(extra)``
    (e.g. per-layer KV scales held outside the module)."""
    return digest_of(((name, tuple(t.shape), t.dtype, tensor_sum(t)) for name, t in named), extra)


def module_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors ``module_fingerprint`` covers: parameters (a tied one once) and buffers."""
    named = dict(module.named_parameters())
    named.update(dict(module.named_buffers()))
    return named


def module_fingerprint(module: torch.nn.Module, extra: object = None) -> str:
    """``fingerprint`` of a module's parameters and buffers."""
    return fingerprint(module_tensors(module).items(), extra)


__all__ = ["as_int", "digest_of", "fingerprint", "module_fingerprint", "module_tensors", "sum_change",
           "tensor_sum", "wrap64"]
