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


def tensor_sum(t: torch.Tensor) -> int:
    """Position-weighted sum of ``t``'s bits (as integers of its element size), on its device."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype.is_floating_point or flat.dtype.is_complex or flat.element_size() in _INT_VIEW:
        flat = flat.view(_INT_VIEW[flat.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), _CHUNK):
        part = flat[start:start + _CHUNK].to(torch.int64)
        w = torch.arange(start, start + part.numel(), device=flat.device, dtype=torch.int64)
        total += (part * (w % _MODULUS + 1)).sum()  # int64 wraps on overflow: still a fingerprint
    return int(total)


def fingerprint(named: Iterable[tuple[str, torch.Tensor]], extra: object = None) -> str:
    """sha256 over ``(name, shape, dtype, tensor_sum)`` of every tensor, plus ``repr(extra)``
    (e.g. per-layer KV scales held outside the module)."""
    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda e: e[0]):
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|{tensor_sum(t)}\n".encode())
    h.update(repr(extra).encode())
    return h.hexdigest()


def module_fingerprint(module: torch.nn.Module, extra: object = None) -> str:
    """``fingerprint`` of a module's parameters and buffers."""
    named = dict(module.named_parameters())
    named.update(dict(module.named_buffers()))
    return fingerprint(named.items(), extra)


__all__ = ["fingerprint", "module_fingerprint", "tensor_sum"]
