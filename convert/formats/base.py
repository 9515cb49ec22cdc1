"""The codec interface every weight format implements, and the quantize/keep policy.

A codec turns one linear weight ``W [out, in]`` (any float dtype) into named tensors that replace
``<module>.weight`` in an HF checkpoint (``quantize``), turns them back into float32
(``dequantize``), says which names, dtypes and shapes those tensors have for a given weight
shape (``tensor_specs``, used by ``verify``), and writes the ``quantization_config`` block of
``config.json`` (plus any extra JSON file the serving stacks read).

Only the projection weights of attention and MLP/expert blocks are quantized. Embeddings,
``lm_head``, every norm and the MoE router (``mlp.gate``) stay in bf16; ``unquantized_modules``
lists them by module name for the configs' ignore lists.

Serving kernels accept only some shapes (``Codec.serving_multiple``: block FP8 both dimensions
multiples of 128, NVFP4 the input dimension a multiple of 16, MXFP4 of 32). ``shape_exclusions``
says which projections a format cannot serve: those stay bf16 and join the ignore lists, so every
loader that claims the format loads the export (``strict`` refuses instead). Members of a fused
projection (q/k/v, gate/up) are kept together: vLLM and SGLang refuse a fused layer whose shards
disagree on quantization.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Mapping

import numpy as np

from convert.qwen3_config import Qwen3Config, hf_tensor_shapes

# Projection weights that a format quantizes (dense MLP, attention, and per-expert MLP).
_QUANTIZED = re.compile(
    r"^(?:.*\.)?layers\.\d+\.(?:self_attn\.[qkvo]_proj|mlp\.(?:experts\.\d+\.)?(?:gate|up|down)_proj)"
    r"\.weight$"
)

TensorSpec = tuple[np.dtype, tuple[int, ...]]

#: ``engines`` values: "serving" applies the serving kernels' shape rules (SGLang, vLLM,
#: transformers); "mixrl" only what this project's engine needs (it handles partial blocks).
ENGINES = ("serving", "mixrl")
#: quantization_config keys under which loaders read the modules left unquantized
#: (transformers ``modules_to_not_convert``, vLLM/SGLang fp8 ``ignored_layers``, ModelOpt
#: ``exclude_modules``, compressed-tensors / SGLang ``ignore``)
IGNORE_KEYS = ("modules_to_not_convert", "ignored_layers", "exclude_modules", "ignore")
# q/k/v and gate/up are fused into one GEMM by vLLM and SGLang: the group key without the member.
_FUSED = re.compile(r"\.(?:self_attn\.([qkv])_proj|mlp\.(?:experts\.\d+\.)?(gate|up)_proj)$")


class ShapeRuleError(ValueError):
    """``strict``: a projection whose shape the format's serving kernels cannot take."""


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


def _fused_key(module: str) -> str:
    m = _FUSED.search(module)
    if not m:
        return module
    return module.rsplit(".", 1)[0] + (".qkv" if m.group(1) else ".gate_up")


def shape_exclusions(cfg: Qwen3Config, codec: Codec, *, engines: str = "serving",
                     strict: bool = False) -> dict[str, str]:
    """``{module: reason}`` of the projections that stay bf16 in a ``codec`` export.

    ``engines="mixrl"``: none (this project's engine takes any shape the codec can encode).
    ``strict``: raise ``ShapeRuleError`` naming the first tensor and the rule instead.
    """
    if engines not in ENGINES:
        raise ValueError(f"engines must be one of {', '.join(ENGINES)}, got {engines!r}")
    if engines == "mixrl" or codec.name == "bf16":
        return {}
    bad: dict[str, str] = {}  # fused group key -> reason
    groups: dict[str, list[str]] = {}
    for name, shape in hf_tensor_shapes(cfg).items():
        if not is_quantized_weight(name):
            continue
        module = module_of(name)
        key = _fused_key(module)
        groups.setdefault(key, []).append(module)
        rule = codec.serving_rule(shape)
        if rule is not None and key not in bad:
            reason = f"{name} {list(shape)}: {rule}"
            if strict:
                raise ShapeRuleError(f"{reason} (--strict; without it the linear stays bf16 and "
                                     "is listed in the quantization config's ignore lists)")
            bad[key] = reason
    return {m: reason for key, reason in bad.items() for m in groups[key]}


def excluded_modules(config: Mapping) -> set[str]:
    """Module names an HF ``config.json`` dict's ``quantization_config`` leaves unquantized."""
    qc = config.get("quantization_config") or {}
    out: set[str] = set()
    for key in IGNORE_KEYS:
        out.update(qc.get(key) or ())
    return out


def stores_quantized(name: str, config: Mapping, excluded: set[str] | None = None) -> bool:
    """Whether HF tensor ``name`` is stored in the format's parts in a checkpoint with ``config``
    (a projection weight, the config quantized, its module not in the ignore lists).
    ``excluded``: ``excluded_modules(config)``, when the caller asks many times."""
    if not is_quantized_weight(name) or not config.get("quantization_config"):
        return False
    return module_of(name) not in (excluded_modules(config) if excluded is None else excluded)


class Codec(abc.ABC):
    """One weight format. Subclasses are stateless; the registry holds one instance each."""

    name: str
    #: suffixes (after ``<module>.``) of the tensors ``quantize`` returns, in writing order
    parts: tuple[str, ...]
    #: tensor names and config convention ("native", or "compressed-tensors")
    layout: str = "native"
    #: (out, in) multiples the serving kernels need; 1 = no constraint
    serving_multiple: tuple[int, int] = (1, 1)
    #: why, for the one-line refusal (the kernels that need it)
    serving_reason: str = ""
    #: ``quantize`` takes ``input_amax`` (a calibrated activation max) for a static input scale
    calibrated_inputs: bool = False

    def serving_rule(self, shape: tuple[int, ...]) -> str | None:
        """The rule a ``[out, in]`` weight breaks for the serving kernels, or ``None``."""
        m_out, m_in = self.serving_multiple
        if shape[0] % m_out == 0 and shape[1] % m_in == 0:
            return None
        if m_out > 1 and m_in > 1:
            need = f"both dimensions multiples of {m_in}" if m_out == m_in else \
                f"out a multiple of {m_out} and in of {m_in}"
        else:
            need = f"the input dimension a multiple of {m_in}" if m_in > 1 else \
                f"the output dimension a multiple of {m_out}"
        return f"{self.name} needs {need} ({self.serving_reason})"

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
