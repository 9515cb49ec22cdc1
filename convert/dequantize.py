"""Read any exported directory back as HF-named float32 tensors (quantized ones dequantized).

The inverse of ``convert.export`` up to the format's rounding: for every tensor of the model's
config, projections are rebuilt with the format's codec from their parts, the rest are read as
stored. Used by ``inspect``, by tests that run a dequantized model, and by any consumer without
kernels for a format (``write_hf_checkpoint(out, dequantized_tensors(d), plain_config(...))``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np

from convert.formats import Codec, detect_format, module_of, stores_quantized
from convert.formats.numerics import load_f32
from convert.hf_checkpoint import HFCheckpoint
from convert.qwen3_config import Qwen3Config, hf_tensor_shapes


def read_tensor(ckpt: HFCheckpoint, codec: Codec, name: str) -> tuple[np.ndarray, dict]:
    """``(float32 value, {suffix: stored part})`` of HF tensor ``name`` in ``ckpt``."""
    if stores_quantized(name, ckpt.config):
        prefix = module_of(name)
        parts = {s: ckpt.get(f"{prefix}.{s}") for s in codec.parts}
        return codec.dequantize(parts), parts
    raw = ckpt.get(name)
    return (load_f32(raw) if raw.ndim else np.float32(raw)), {"weight": raw}


def dequantized_tensors(path: str | os.PathLike) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(hf_name, float32)`` for every tensor the config needs, one at a time."""
    ckpt = HFCheckpoint(path)
    codec = detect_format(ckpt.config)
    cfg = Qwen3Config.from_hf_dict(ckpt.config)
    for name in hf_tensor_shapes(cfg):
        yield name, read_tensor(ckpt, codec, name)[0]


def plain_config(config: dict) -> dict:
    """``config`` without its ``quantization_config`` (for a dequantized copy)."""
    return {k: v for k, v in config.items() if k != "quantization_config"}
