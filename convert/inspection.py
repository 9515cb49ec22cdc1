"""``inspect``: per-tensor dequantization statistics of an exported directory.

For every weight of the model (quantized projections dequantized through the format's codec,
other tensors as stored) report its dtype/shape and value statistics; with a reference
directory (``against``, normally the bf16 export or the original HF checkpoint) also the error
of the dequantized tensor against the reference: max |err|, RMS err, and RMS err relative to the
reference RMS.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from convert.dequantize import read_tensor
from convert.formats import detect_format, stores_quantized
from convert.hf_checkpoint import HFCheckpoint
from convert.qwen3_config import Qwen3Config, hf_tensor_shapes


@dataclasses.dataclass
class TensorStats:
    name: str
    stored: str  # "fp8_block (float8_e4m3fn)" for quantized weights, else the stored dtype
    shape: tuple[int, ...]
    amax: float
    rms: float
    zero_fraction: float
    max_abs_err: float | None = None
    rms_err: float | None = None
    rel_rms_err: float | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def iter_stats(path: str | os.PathLike,
               against: str | os.PathLike | None = None) -> Iterator[TensorStats]:
    """Yield ``TensorStats`` for every model weight in ``path``, one tensor in memory at a time."""
    ckpt = HFCheckpoint(path)
    ref = HFCheckpoint(against) if against is not None else None
    codec = detect_format(ckpt.config)
    cfg = Qwen3Config.from_hf_dict(ckpt.config)
    for name in hf_tensor_shapes(cfg):
        value, parts = read_tensor(ckpt, codec, name)
        if stores_quantized(name, ckpt.config):
            stored = f"{codec.name} ({parts['weight'].dtype})"
        else:
            stored = str(parts["weight"].dtype)
        stats = TensorStats(name=name, stored=stored, shape=tuple(value.shape),
                            amax=float(np.max(np.abs(value))),
                            rms=float(np.sqrt(np.mean(np.square(value, dtype=np.float64)))),
                            zero_fraction=float(np.mean(value == 0)))
        if ref is not None:
            expected = read_tensor(ref, detect_format(ref.config), name)[0]
            if expected.shape != value.shape:
                raise ValueError(f"{name}: shape {value.shape} differs from the reference's "
                                 f"{expected.shape}")
            err = (value - expected).astype(np.float64)
            ref_rms = float(np.sqrt(np.mean(np.square(expected, dtype=np.float64))))
            stats.max_abs_err = float(np.max(np.abs(err)))
            stats.rms_err = float(np.sqrt(np.mean(err * err)))
            stats.rel_rms_err = stats.rms_err / ref_rms if ref_rms > 0 else (
                0.0 if stats.rms_err == 0 else float("inf"))
        yield stats


def inspect_dir(path: str | os.PathLike,
                against: str | os.PathLike | None = None) -> list[TensorStats]:
    return list(iter_stats(Path(path), against))
