"""The codec interface every weight format implements, and the quantize/keep policy.

A codec turns one linear weight ``W [out, in]`` (any float dtype) into named tensors that replace
``<module>.weight`` in an HF checkpoint (``quantize``), turns them back into float32
(``dequantize``), says which names, dtypes and shapes those tensors have for a given weight
shape (``tensor_specs``, used by ``verify``), and writes the ``quantization_config`` block of
``config.json`` (plus any extra JSON file the serving stacks read).

Only the projection weights of attention and MLP/expert blocks are quantized. Embeddings,
``lm_head``, every norm and the MoE router (``mlp.gate``) stay in bf16; ``unquantized_modules``
lists them by module name for the configs' ignore lists.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Mapping

import numpy as np

from convert.qwen3_config import Qwen3Config

# Projection weights that a format quantizes (dense MLP, attention, and per-expert MLP).
_QUANTIZED = re.compile(
    r"^(?:.*\.)?layers\.\d+\.(?:self_attn\.[qkvo]_proj|mlp\.(?:experts\.\d+\.)?(?:gate|up|down)_proj)"
    r"\.weight$"
)

TensorSpec = tuple[np.dtype, tuple[int, ...]]


def is_quantized_weight(name: str) -> bool:
    """Whether a format quantizes the HF tensor ``name`` (projection weights only)."""
    return bool(_QUANTIZED.match(name))


def module_of(name: str) -> str:
    """``model.layers.0.mlp.up_proj.weight`` -> ``model.layers.0.mlp.up_proj``."""
    if not name.endswith(".weight"):
        raise ValueError(f"{name!r} is not a weight tensor name")
    return name[: -len(".weight")]


def unquantized_modules(cfg: Qwen3Config) -> list[str]:
    """Module names that stay unquantized: embeddings, lm_head, norms, MoE routers.

    Exact names (not patterns) because SGLang's and vLLM's fp8 loaders match ``ignored_layers``
    exactly; transformers matches them as prefixes at a module boundary, which is equivalent
    here. Norms are listed as Qwen's own FP8 releases do, although no loader would quantize them.
    """
    names = ["lm_head", "model.embed_tokens"]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        names += [f"{p}.input_layernorm", f"{p}.post_attention_layernorm",
                  f"{p}.self_attn.q_norm", f"{p}.self_attn.k_norm"]
        if cfg.layer_is_sparse(i):
            names.append(f"{p}.mlp.gate")
    names.append("model.norm")
    return names


class Codec(abc.ABC):
    """One weight format. Subclasses are stateless; the registry holds one instance each."""

    name: str
    #: suffixes (after ``<module>.``) of the tensors ``quantize`` returns, in writing order
    parts: tuple[str, ...]

    @abc.abstractmethod
    def quantize(self, w: np.ndarray, *, what: str = "tensor") -> dict[str, np.ndarray]:
        """``W [out, in]`` -> ``{suffix: tensor}``; raises ``QuantizationError`` on NaN/Inf."""

    @abc.abstractmethod
    def dequantize(self, parts: Mapping[str, np.ndarray]) -> np.ndarray:
        """``{suffix: tensor}`` -> float32 ``[out, in]``."""

    @abc.abstractmethod
    def tensor_specs(self, shape: tuple[int, int]) -> dict[str, TensorSpec]:
        """``{suffix: (dtype, shape)}`` that ``quantize`` produces for a weight of ``shape``."""

    def quantization_config(self, ignore: list[str], *,
                            kv_cache_fp8: bool = False) -> dict | None:
        """The ``quantization_config`` block of ``config.json`` (``None``: plain HF)."""
        return None

    def extra_files(self, ignore: list[str], *, kv_cache_fp8: bool = False) -> dict[str, dict]:
        """Further JSON files to write beside ``config.json`` (name -> content)."""
        return {}

    @classmethod
    def matches(cls, quantization_config: Mapping | None) -> bool:
        """Whether a ``quantization_config`` block (or its absence) describes this format."""
        return False
