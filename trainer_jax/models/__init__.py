"""Qwen3 / Qwen3-MoE for the trainer, with HF checkpoint loading and saving."""

from __future__ import annotations

import os
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from convert.hf_checkpoint import HFCheckpoint, write_hf_checkpoint
from convert.qwen3_config import Qwen3Config
from trainer_jax.models.hf_params import iter_hf_tensors, load_hf_tensors, param_map
from trainer_jax.models.qwen3 import Qwen3

__all__ = ["Qwen3", "Qwen3Config", "init_model", "iter_hf_tensors", "load_hf", "param_map",
           "save_hf"]


def init_model(cfg: Qwen3Config, *, dtype=jnp.float32, param_dtype=None, seed: int = 0,
               moe_impl: str | None = None, attention_impl: str | None = None,
               remat: str = "none") -> Qwen3:
    """A randomly initialised model (normal(0.02) weights, unit norms)."""
    return Qwen3(cfg, dtype=dtype, param_dtype=param_dtype or dtype, rngs=nnx.Rngs(seed),
                 moe_impl=moe_impl, attention_impl=attention_impl, remat=remat)


def load_hf(path: str | os.PathLike, dtype=jnp.float32, *, param_dtype=None,
            moe_impl: str | None = None, attention_impl: str | None = None,
            remat: str = "none") -> tuple[Qwen3, Qwen3Config]:
    """Load an HF Qwen3 / Qwen3-MoE directory; compute in ``dtype``, store in ``param_dtype``.

    ``moe_impl`` picks the expert grouped matmul (see ``grouped_matmul``; default by backend);
    ``attention_impl`` and ``remat`` are ``Qwen3``'s (``attention.py``, ``remat.py``).

    The model is built abstractly (no random init) and filled tensor by tensor from the
    safetensors shards, so host memory peaks near one tensor (one layer's experts for MoE).
    """
    ckpt = HFCheckpoint(path)
    cfg = Qwen3Config.from_hf_dict(ckpt.config)
    model = nnx.eval_shape(lambda: Qwen3(cfg, dtype=dtype, param_dtype=param_dtype or dtype,
                                         rngs=nnx.Rngs(0), moe_impl=moe_impl,
                                         attention_impl=attention_impl, remat=remat))
    load_hf_tensors(model, ckpt.get)
    return model, cfg


_SAVE_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def save_hf(model: Qwen3, config: Qwen3Config, path: str | os.PathLike, *,
            dtype: str | None = None, tokenizer_dir: str | os.PathLike | None = None,
            max_shard_bytes: int | None = None, overwrite: bool = False) -> Path:
    """Write ``model`` as an HF directory transformers loads unchanged (atomic: temp dir, rename).

    ``dtype`` is the stored dtype name (default: the parameters' own, so the round trip is exact).
    """
    if dtype is None:
        dtype = jnp.dtype(model.embed_tokens.embedding.get_value().dtype).name
    if dtype not in _SAVE_DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {list(_SAVE_DTYPES)}")
    hf_config = config.to_hf_dict()
    hf_config["torch_dtype"] = hf_config["dtype"] = dtype
    kwargs = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    return write_hf_checkpoint(path, iter_hf_tensors(model, _SAVE_DTYPES[dtype]), hf_config,
                               copy_files_from=tokenizer_dir, overwrite=overwrite, **kwargs)
