"""Build the sampler model for a recipe from a converter export directory.

The export must be in the recipe's weight format (its ``config.json`` ``quantization_config``
says which, ``convert.formats.detect_format``). Unquantized tensors (embeddings, lm_head, norms,
router) are cast to the compute dtype; each quantized projection's tensors are checked against
the codec's ``tensor_specs`` and become the recipe's module (``sampler_torch.recipes.linear``).
Projections a mixed export lists in its ignore lists (``convert.formats.shape_exclusions``) are
bf16 there and become plain linears in the compute dtype. Every check happens before the model
is returned, so a bad export raises and nothing changes.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from convert.formats import detect_format, excluded_modules, module_of, stores_quantized
from convert.formats.base import Codec
from convert.hf_checkpoint import HFCheckpoint
from convert.manifest import check_manifest, read_manifest
from convert.qwen3_config import Qwen3Config, hf_tensor_shapes
from sampler_torch.models import Qwen3ForCausalLM
from sampler_torch.recipes.linear import make_linear
from sampler_torch.recipes.registry import Recipe, RecipeError, resolve_attention, torch_dtype
from sampler_torch.recipes.rounding import RoundWeights, check_recipe, round_model_weights, round_spec
from sampler_torch.tensors import to_torch


class WeightLoadError(RuntimeError):
    """An export failed verification or loading; the caller's current weights are untouched."""


@dataclasses.dataclass
class LoadedModel:
    model: Qwen3ForCausalLM
    config: Qwen3Config
    path: Path
    weight_format: str
    #: per-layer FP8 KV scales from the export (``None`` when it has none)
    k_scales: list[float] | None
    v_scales: list[float] | None
    manifest: dict | None
    #: the export's ``config.json`` (quantization config included)
    hf_config: dict = dataclasses.field(default_factory=dict)


def verify_export(path: str | os.PathLike, *, require_manifest: bool = True) -> dict | None:
    """Check ``path`` against its ``manifest.json`` (sizes and sha256 of every file).

    Raises ``WeightLoadError`` naming the bad files. Without a manifest: an error when
    ``require_manifest``, else ``None`` (a plain HF directory, e.g. for tests and first loads).
    """
    path = Path(path)
    if not (path / "manifest.json").exists() and not require_manifest:
        return None
    problems = check_manifest(path)
    if problems:
        raise WeightLoadError(f"{path}: refusing to load, the export does not match its manifest: "
                              + "; ".join(problems))
    return read_manifest(path)


def kv_scale_names(layer: int, which: str) -> tuple[str, str]:
    """Where an export keeps layer ``layer``'s ``k`` or ``v`` cache scale: SGLang/vLLM read
    ``self_attn.{k,v}_scale``; ModelOpt writes ``self_attn.{k,v}_proj.*``."""
    return (f"model.layers.{layer}.self_attn.{which}_scale",
            f"model.layers.{layer}.self_attn.{which}_proj.{which}_scale")


def kv_scale_value(arr: np.ndarray, name: str, where: object) -> float:
    """The positive scalar a KV scale tensor holds; ``WeightLoadError`` otherwise."""
    value = float(np.asarray(arr, np.float32).reshape(()))
    if not (np.isfinite(value) and value > 0):
        raise WeightLoadError(f"{where}: {name} = {value} is not a positive scale")
    return value


def _kv_scale(ckpt: HFCheckpoint, layer: int, which: str) -> float | None:
    for name in kv_scale_names(layer, which):
        if name in ckpt:
            return kv_scale_value(ckpt.get(name), name, ckpt.path)
    return None


def check_part(where: object, name: str, dtype: np.dtype, shape: tuple[int, ...],
               spec: tuple[np.dtype, tuple[int, ...]]) -> None:
    """``WeightLoadError`` unless a quantized part's dtype and shape are the codec's ``spec``."""
    if np.dtype(dtype) != np.dtype(spec[0]) or tuple(shape) != tuple(spec[1]):
        raise WeightLoadError(f"{where}: {name} is {np.dtype(dtype)}{list(shape)}, the format "
                              f"needs {np.dtype(spec[0])}{list(spec[1])}")


def check_plain(where: object, name: str, dtype: np.dtype, shape: tuple[int, ...],
                want: tuple[int, ...]) -> None:
    """``WeightLoadError`` unless an unquantized tensor is a float array of the config's shape."""
    if tuple(shape) != tuple(want):
        raise WeightLoadError(f"{where}: {name} has shape {tuple(shape)}, the config says {want}")
    if not (np.issubdtype(dtype, np.floating) or np.dtype(dtype).name == "bfloat16"):
        raise WeightLoadError(f"{where}: {name} has dtype {dtype}, expected a float")


@dataclasses.dataclass(frozen=True)
class ExportLayout:
    """Which tensors an export of a config and format holds, and how the model uses them."""

    cfg: Qwen3Config
    codec: Codec
    #: HF tensor name -> shape, as the config gives it
    shapes: dict[str, tuple[int, ...]]
    #: the HF weights stored in the codec's parts (``{module}.{suffix}``), the rest are plain
    quantized: frozenset[str]

    @classmethod
    def of(cls, config: dict, codec: Codec) -> ExportLayout:
        cfg = Qwen3Config.from_hf_dict(config)
        shapes = hf_tensor_shapes(cfg)
        # A mixed export keeps the projections its format cannot serve in bf16 and lists them
        # in the quantization config's ignore lists: those load as plain linears.
        excluded = excluded_modules(config)
        return cls(cfg, codec, shapes,
                   frozenset(n for n in shapes if stores_quantized(n, config, excluded)))

    def expected(self) -> set[str]:
        """Every tensor name the export must hold (KV scales aside)."""
        names = {n for n in self.shapes if n not in self.quantized}
        for name in self.quantized:
            names |= {f"{module_of(name)}.{suffix}" for suffix in self.codec.parts}
        return names

    def kv_names(self) -> set[str]:
        return {n for i in range(self.cfg.num_hidden_layers) for w in ("k", "v")
                for n in kv_scale_names(i, w)}


def check_names(where: object, lay: ExportLayout, present: set[str]) -> None:
    """``WeightLoadError`` unless an export holds exactly the tensors ``lay`` needs (and KV scales)."""
    expected = lay.expected()
    missing = sorted(expected - present)
    if missing:
        raise WeightLoadError(f"{where}: missing {len(missing)} tensor(s) of a "
                              f"{lay.codec.name} export, e.g. {missing[:3]}")
    unexpected = sorted(present - expected - lay.kv_names())
    if unexpected:
        raise WeightLoadError(f"{where}: unexpected tensor(s) for this config and format, "
                              f"e.g. {unexpected[:3]}")


def _set_submodule(model: nn.Module, dotted: str, module: nn.Module) -> None:
    parent, _, leaf = dotted.rpartition(".")
    setattr(model.get_submodule(parent), leaf, module)


def _load(ckpt: HFCheckpoint, codec: Codec, recipe: Recipe, device) -> tuple[
        Qwen3ForCausalLM, Qwen3Config]:
    lay = ExportLayout.of(ckpt.config, codec)
    cfg, shapes, quantized = lay.cfg, lay.shapes, lay.quantized
    check_names(ckpt.path, lay, set(ckpt.names()))

    dtype = torch_dtype(recipe)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    for name in quantized:  # placeholders: the real modules are built from the export below
        _set_submodule(model, module_of(name), nn.Identity())
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:  # to_empty breaks the tie; restore it before filling
        model.lm_head.weight = model.model.embed_tokens.weight
    params = dict(model.named_parameters(remove_duplicate=False))
    for name in shapes:
        if name in quantized:
            continue
        arr = ckpt.get(name)
        check_plain(ckpt.path, name, arr.dtype, arr.shape, shapes[name])
        with torch.no_grad():
            params[name].copy_(to_torch(arr).to(dtype))
    for name in sorted(quantized):
        module = module_of(name)
        specs = codec.tensor_specs(shapes[name])
        parts = {}
        for suffix, spec in specs.items():
            check_part(ckpt.path, f"{module}.{suffix}", *ckpt.info(f"{module}.{suffix}"), spec)
            parts[suffix] = ckpt.get(f"{module}.{suffix}")
        _set_submodule(model, module, make_linear(recipe, parts, device).to(device))
    model.set_attention_impl(resolve_attention(recipe.attention, torch.device(device).type))
    return model.eval().requires_grad_(False), cfg


def load_model(path: str | os.PathLike, recipe: Recipe, *, device: str | torch.device = "cpu",
               require_manifest: bool = False, round_weights: RoundWeights | None = None) -> LoadedModel:
    """Verify (manifest when present or required) and load ``path`` for ``recipe``.

    ``round_weights`` (default: the recipe's, when it has one): round every quantizable linear of
    the loaded weights to symmetric per-block K-bit integers (``sampler_torch.recipes.rounding``),
    with scales from these weights -- every load, hence every reload, recomputes them.
    Raises ``WeightLoadError`` (bad or mismatched files) or ``RecipeError`` (the export is in
    another format than the recipe needs, or a dial the recipe cannot apply).
    """
    spec = round_spec(recipe, round_weights)
    if spec is not None:
        check_recipe(recipe)
    path = Path(path)
    manifest = verify_export(path, require_manifest=require_manifest)
    try:
        ckpt = HFCheckpoint(path)
        codec = detect_format(ckpt.config)
    except (ValueError, OSError) as e:
        raise WeightLoadError(f"{path}: cannot read the export ({e})") from e
    if codec.layout != "native":
        raise WeightLoadError(f"{path} is in the {codec.layout} layout, which vLLM loads; the "
                              "mixrl engine loads this project's native layout (export without "
                              "--layout)")
    if codec.name != recipe.weight_format:
        raise RecipeError(f"{path} holds {codec.name} weights; recipe {recipe.name!r} needs "
                          f"{recipe.weight_format} (export that format for this group)")
    try:
        model, cfg = _load(ckpt, codec, recipe, device)
        k = [_kv_scale(ckpt, i, "k") for i in range(cfg.num_hidden_layers)]
        v = [_kv_scale(ckpt, i, "v") for i in range(cfg.num_hidden_layers)]
    except WeightLoadError:
        raise
    except (ValueError, KeyError, OSError, RuntimeError) as e:  # safetensors / codec errors
        raise WeightLoadError(f"{path}: cannot load the export ({type(e).__name__}: {e})") from e
    if spec is not None:
        round_model_weights(model, spec)
    has_k = any(s is not None for s in k)
    return LoadedModel(model=model, config=cfg, path=path, weight_format=codec.name,
                       k_scales=[s or 1.0 for s in k] if has_k else None,
                       v_scales=[s or 1.0 for s in v] if has_k else None, manifest=manifest,
                       hf_config=dict(ckpt.config))


__all__ = ["ExportLayout", "LoadedModel", "WeightLoadError", "check_names", "check_part", "check_plain",
           "kv_scale_names", "kv_scale_value", "load_model", "verify_export"]
