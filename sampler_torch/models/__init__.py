"""Qwen3 / Qwen3-MoE for the sampler, loaded from HF checkpoint directories."""

from __future__ import annotations

import os

import torch

from convert.hf_checkpoint import HFCheckpoint
from convert.qwen3_config import Qwen3Config, hf_tensor_shapes
from sampler_torch.models.kv_cache import KVCache
from sampler_torch.models.qwen3 import Qwen3ForCausalLM
from sampler_torch.tensors import to_torch

__all__ = ["KVCache", "Qwen3ForCausalLM", "load_hf", "load_state_from_hf"]


def load_state_from_hf(model: Qwen3ForCausalLM, ckpt: HFCheckpoint, dtype: torch.dtype) -> None:
    """Copy every HF tensor into the parameter of the same name, one tensor at a time."""
    shapes = hf_tensor_shapes(model.config)
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, shape in shapes.items():
        arr = ckpt.get(name)
        if tuple(arr.shape) != shape:
            raise ValueError(f"{ckpt.path}: tensor {name!r} has shape {tuple(arr.shape)}, the config "
                             f"says {shape}")
        with torch.no_grad():
            params[name].copy_(to_torch(arr).to(dtype))


def load_hf(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
            device: str | torch.device = "cpu") -> Qwen3ForCausalLM:
    """Load an HF Qwen3 / Qwen3-MoE directory into the sampler model (eval mode, no grad)."""
    ckpt = HFCheckpoint(path)
    cfg = Qwen3Config.from_hf_dict(ckpt.config)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:  # to_empty breaks the tie; restore it before filling
        model.lm_head.weight = model.model.embed_tokens.weight
    load_state_from_hf(model, ckpt, dtype)
    return model.eval().requires_grad_(False)
