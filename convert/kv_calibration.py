"""FP8 KV-cache scales for an export: the calibration ids, and the registered calibrator.

Calibrating needs a model forward pass, which only the samplers have (``sampler_torch``
registers ``sampler_torch.kv_calibration.calibrate_kv_scales`` through the ``mixrl.convert``
entry point; see ``convert.plugins``). This module holds what ``convert`` owns: reading the
token ids and validating the scales a calibrator returns before they are written.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

from convert.plugins import kv_calibrator


def load_calibration_ids(path: str | os.PathLike) -> np.ndarray:
    """Token ids ``[B, T]`` from a ``.npy`` file or a JSON list of equal-length lists."""
    p = str(path)
    if p.endswith(".npy"):
        ids = np.load(p)
    else:
        with open(p) as f:
            ids = np.asarray(json.load(f))
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{p}: expected integer token ids of shape [B, T], got {ids.dtype}"
                         f"{list(ids.shape)}")
    return ids


def calibrate_kv_scales(hf_dir: str | os.PathLike,
                        input_ids) -> dict[int, tuple[float, float]]:
    """``{layer: (k_scale, v_scale)}`` from the registered calibrator run on ``hf_dir``.

    Raises ``convert.plugins.PluginError`` (one line naming what to install) when no calibrator
    can be loaded.
    """
    scales = kv_calibrator()(hf_dir, np.asarray(input_ids))
    # A provider's output goes straight into the export: refuse values no serving stack can use.
    for layer, pair in scales.items():
        if len(pair) != 2 or not all(math.isfinite(s) and s > 0 for s in pair):
            raise ValueError(f"KV calibrator returned scales {pair!r} for layer {layer}; "
                             "expected two positive finite floats")
    return scales
