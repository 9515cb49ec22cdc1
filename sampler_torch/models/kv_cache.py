"""A slot-addressed KV cache for incremental decoding.

The cache holds ``slots`` independent sequences (the engine's batch slots). Each forward names the
slot of every row and the absolute position of every token, so rows of different lengths, a
prefill of one slot while others decode, and refilling a finished slot all use the same calls.

Entries are written at their positions; a query at position p attends keys 0..p of its slot. Keys
past p may hold stale data from an earlier occupant or padding, which is why the mask is by
position and a slot needs no clearing when it is reused.

Subclasses change the storage (e.g. FP8 with per-layer scales) by overriding ``write``/``read``.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int,
                 *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (slots, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self.slots = slots

    @classmethod
    def for_model(cls, cfg, slots: int, max_len: int, **kwargs) -> KVCache:
        return cls(cfg.num_hidden_layers, slots, cfg.num_key_value_heads, max_len, cfg.head_dim,
                   **kwargs)

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v [B, K, T, hd]`` of rows ``slots [B]`` at ``positions [B, T]``."""
        if int(positions.max()) >= self.max_len:
            raise ValueError(f"position {int(positions.max())} is past the cache length {self.max_len}")
        self.store(layer, slots, positions, k, v)

    def store(self, layer: int, slots: torch.Tensor, positions: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """``write`` without the bounds check (a device sync), for callers that checked once
        for all layers of a forward."""
        rows = slots[:, None]
        # Advanced indices around a slice put the indexed dims first: the target is [B, T, K, hd].
        self.k[layer][rows, :, positions] = k.transpose(1, 2).to(self.k[layer].dtype)
        self.v[layer][rows, :, positions] = v.transpose(1, 2).to(self.v[layer].dtype)

    def read(self, layer: int, slots: torch.Tensor, length: int,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, K, length, hd]`` of rows ``slots``, in compute ``dtype``."""
        return (self.k[layer][slots, :, :length].to(dtype),
                self.v[layer][slots, :, :length].to(dtype))
