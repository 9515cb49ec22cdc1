"""KV caches in the dtype a recipe names.

``ScaledFP8KVCache`` stores keys and values as float8 (e4m3fn or e5m2) with one float32 scale
per layer for keys and one for values, as SGLang/vLLM do with ``--kv-cache-dtype fp8_*``:
``stored = fp8(clamp(k / k_scale, +-max))`` on write, ``k ~= float(stored) * k_scale`` on read.
Scales come from the export (``model.layers.{i}.self_attn.k_scale`` / ``v_scale``) when it has
them, else 1.0 (the serving stacks' default). A cache keeps the scales it was built with for its
whole life: entries written under one scale must be read back under the same one, so an
in-flight weight reload does not rescale entries already in the cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sampler_torch.models import KVCache
from sampler_torch.recipes.numerics import E4M3_MAX, E5M2_MAX

_FP8_MAX = {torch.float8_e4m3fn: E4M3_MAX, torch.float8_e5m2: E5M2_MAX}


class ScaledFP8KVCache(KVCache):
    def __init__(self, num_layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int,
                 *, dtype: torch.dtype = torch.float8_e4m3fn, device: torch.device | str = "cpu",
                 k_scales: Sequence[float] | None = None, v_scales: Sequence[float] | None = None):
        if dtype not in _FP8_MAX:
            raise ValueError(f"ScaledFP8KVCache stores float8_e4m3fn or float8_e5m2, not {dtype}")
        super().__init__(num_layers, slots, kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.fp8_max = _FP8_MAX[dtype]
        ones = [1.0] * num_layers
        self.k_scales = [float(s) for s in (k_scales if k_scales is not None else ones)]
        self.v_scales = [float(s) for s in (v_scales if v_scales is not None else ones)]
        if len(self.k_scales) != num_layers or len(self.v_scales) != num_layers:
            raise ValueError(f"need one k/v scale per layer ({num_layers})")

    def _encode(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        # Clamp first: e5m2 overflows to inf rather than saturating.
        return (x.float() / scale).clamp(-self.fp8_max, self.fp8_max).to(self.k[0].dtype)

    # Stores and gathers go through uint8 views of the same bytes: indexing kernels for float8
    # dtypes are missing on some devices / torch builds, byte copies are everywhere.

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        if int(positions.max()) >= self.max_len:
            raise ValueError(f"position {int(positions.max())} is past the cache length {self.max_len}")
        rows = slots[:, None]
        for store, x, scale in ((self.k, k, self.k_scales[layer]), (self.v, v, self.v_scales[layer])):
            codes = self._encode(x, scale).transpose(1, 2).contiguous().view(torch.uint8)
            store[layer].view(torch.uint8)[rows, :, positions] = codes

    def read(self, layer: int, slots: torch.Tensor, length: int,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        fp8 = self.k[layer].dtype
        k = self.k[layer].view(torch.uint8)[slots, :, :length].view(fp8).float()
        v = self.v[layer].view(torch.uint8)[slots, :, :length].view(fp8).float()
        return (k * self.k_scales[layer]).to(dtype), (v * self.v_scales[layer]).to(dtype)


def make_kv_cache(cfg, slots: int, max_len: int, dtype: torch.dtype,
                  k_scales: Sequence[float] | None = None,
                  v_scales: Sequence[float] | None = None, *,
                  device: torch.device | str = "cpu") -> KVCache:
    """A cache for ``slots`` sequences of up to ``max_len`` tokens, stored as ``dtype`` on
    ``device`` (the engine's: a cache elsewhere would copy every layer's keys each step)."""
    if dtype in _FP8_MAX:
        return ScaledFP8KVCache.for_model(cfg, slots, max_len, dtype=dtype, k_scales=k_scales,
                                          v_scales=v_scales, device=device)
    return KVCache.for_model(cfg, slots, max_len, dtype=dtype, device=device)
