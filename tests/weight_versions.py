"""Successive weight versions of a tiny model, and the byte-identity check of two exports
(shared by the delta, store and sampler catch-up tests)."""

import json
from pathlib import Path

import numpy as np

from convert.qwen3_config import Qwen3Config, hf_tensor_shapes

CFG = Qwen3Config(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=64)
FORMATS = ["bf16", "fp8_block", "nvfp4", "mxfp4", "w8a8_int8"]


def versions_of_weights(n: int, seed: int = 0) -> list[dict]:
    """``n`` successive fp32 parameter sets, each an Adam-like step (a small signed update on
    every element) from the one before."""
    rng = np.random.default_rng(seed)
    p = {k: (rng.standard_normal(s) * 0.02).astype(np.float32) for k, s in hf_tensor_shapes(CFG).items()}
    out = []
    for _ in range(n):
        p = {k: a + 3e-5 * np.sign(rng.standard_normal(a.shape)).astype(np.float32) for k, a in p.items()}
        out.append(p)
    return out


def assert_same_export(got: Path, want: Path) -> None:
    """Every file byte-identical; manifest.json too except its creation time (publish time)."""
    names = sorted(p.relative_to(want).as_posix() for p in want.rglob("*") if p.is_file())
    assert sorted(p.relative_to(got).as_posix() for p in got.rglob("*") if p.is_file()) == names
    for rel in names:
        if rel == "manifest.json":
            a, b = json.loads((got / rel).read_text()), json.loads((want / rel).read_text())
            a.pop("created_unix"), b.pop("created_unix")
            assert a == b
        else:
            assert (got / rel).read_bytes() == (want / rel).read_bytes(), rel
