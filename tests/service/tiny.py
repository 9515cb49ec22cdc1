"""A tiny random Qwen3 over the character tokenizer, written with numpy only (fast, no torch/JAX)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from convert.hf_checkpoint import write_hf_checkpoint
from convert.qwen3_config import Qwen3Config, hf_tensor_shapes
from convert.tokenizer import char_tokenizer


def tiny_char_model(path: Path, seed: int = 0) -> Path:
    """Write an HF directory (config, safetensors, tokenizer.json) of a 1-layer Qwen3 to ``path``."""
    tok = char_tokenizer()
    cfg = Qwen3Config(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      tie_word_embeddings=True, max_position_embeddings=512)
    tok_dir = path.parent / f".{path.name}-tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(tok_dir / "tokenizer.json"))
    rng = np.random.default_rng(seed)

    def tensors():
        for name, shape in hf_tensor_shapes(cfg).items():
            if name.endswith("norm.weight"):
                yield name, np.ones(shape, np.float32)
            else:
                yield name, (rng.normal(size=shape) * 0.5).astype(np.float32)

    return write_hf_checkpoint(path, tensors(), cfg.to_hf_dict(), copy_files_from=tok_dir)
