"""Per-layer FP8 KV-cache scales from a calibration batch, with the sampler's own model.

An FP8 (e4m3) KV cache stores ``k / k_scale`` and ``v / v_scale``; SGLang and vLLM read the
scales from ``model.layers.{i}.self_attn.k_scale`` / ``v_scale`` (float32 scalars). We run the
sampler's PyTorch model (``sampler_torch.models``) over a calibration batch with a KV cache
that records the max |K| (after q/k-norm and RoPE, exactly what is cached) and max |V| per layer,
and choose ``scale = amax / 448`` (``convert.calibration.kv_scale``) so the largest calibrated
entry maps to e4m3's max.

``mixrl-convert --kv-calibration`` reaches this through the ``mixrl.convert`` entry point
``register`` (``convert`` sits below the samplers and never imports them). torch is imported
only when calibrating, so registering costs nothing where torch is absent.
"""

from __future__ import annotations

import os

import numpy as np

from convert.calibration import kv_scale


def calibrate_kv_scales(model_or_dir, input_ids, *, dtype=None) -> dict[int, tuple[float, float]]:
    """``{layer: (k_scale, v_scale)}`` from running ``input_ids [B, T]`` through the model.

    ``model_or_dir``: a ``sampler_torch.models.Qwen3ForCausalLM`` or an HF directory (loaded
    in ``dtype``, default float32).
    """
    import torch

    from sampler_torch.models import KVCache, load_hf

    if isinstance(model_or_dir, (str, os.PathLike)):
        model = load_hf(model_or_dir, dtype=dtype or torch.float32)
    else:
        model = model_or_dir
    ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long)
    if ids.ndim != 2 or ids.numel() == 0:
        raise ValueError(f"calibration input_ids must be a non-empty [B, T] array, got "
                         f"{tuple(ids.shape)}")
    if int(ids.min()) < 0 or int(ids.max()) >= model.config.vocab_size:
        raise ValueError(f"calibration token ids must lie in [0, {model.config.vocab_size})")

    class AmaxCache(KVCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.amax = np.zeros((len(self.k), 2))

        def write(self, layer, slots, positions, k, v):
            self.amax[layer, 0] = max(self.amax[layer, 0], float(k.detach().abs().max()))
            self.amax[layer, 1] = max(self.amax[layer, 1], float(v.detach().abs().max()))
            super().write(layer, slots, positions, k, v)

    param = next(model.parameters())
    cache = AmaxCache.for_model(model.config, slots=ids.shape[0], max_len=ids.shape[1],
                                dtype=param.dtype, device=param.device)
    with torch.no_grad():
        model(ids.to(param.device), cache=cache)
    if not np.isfinite(cache.amax).all():
        raise ValueError("calibration produced NaN/Inf keys or values")
    return {i: (kv_scale(float(k)), kv_scale(float(v))) for i, (k, v) in enumerate(cache.amax)}


def register() -> None:
    """Entry point (group ``mixrl.convert``): serve ``mixrl-convert --kv-calibration``."""
    from convert.plugins import register_kv_calibrator

    register_kv_calibrator(calibrate_kv_scales, name="sampler_torch", requires=("torch",))
