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
from sampler_torch.recipes.rounding import RoundWeights, check_recipe, round_model_weights
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


def _kv_scale(ckpt: HFCheckpoint, layer: int, which: str) -> float | None:
    # SGLang/vLLM read ``self_attn.{k,v}_scale``; ModelOpt writes ``self_attn.{k,v}_proj.*``.
    for name in (f"model.layers.{layer}.self_attn.{which}_scale",
                 f"model.layers.{layer}.self_attn.{which}_proj.{which}_scale"):
        if name in ckpt:
            value = float(np.asarray(ckpt.get(name), np.float32).reshape(()))
            if not (np.isfinite(value) and value > 0):
                raise WeightLoadError(f"{ckpt.path}: {name} = {value} is not a positive scale")
            return value
    return None


def _check_part(ckpt: HFCheckpoint, name: str, spec: tuple[np.dtype, tuple[int, ...]]) -> None:
    dtype, shape = ckpt.info(name)
    if np.dtype(dtype) != np.dtype(spec[0]) or tuple(shape) != tuple(spec[1]):
        raise WeightLoadError(f"{ckpt.path}: {name} is {np.dtype(dtype)}{list(shape)}, the format "
                              f"needs {np.dtype(spec[0])}{list(spec[1])}")


def _set_submodule(model: nn.Module, dotted: str, module: nn.Module) -> None:
    parent, _, leaf = dotted.rpartition(".")
    setattr(model.get_submodule(parent), leaf, module)


def _load(ckpt: HFCheckpoint, codec: Codec, recipe: Recipe, device) -> tuple[
        Qwen3ForCausalLM, Qwen3Config]:
    cfg = Qwen3Config.from_hf_dict(ckpt.config)
    shapes = hf_tensor_shapes(cfg)
    # A mixed export keeps the projections its format cannot serve in bf16 and lists them in
    # the quantization config's ignore lists: those load as plain linears.
    excluded = excluded_modules(ckpt.config)
    quantized = {n for n in shapes if stores_quantized(n, ckpt.config, excluded)}
    expected = {n for n in shapes if n not in quantized}
    for name in quantized:
        expected |= {f"{module_of(name)}.{suffix}" for suffix in codec.parts}
    present = set(ckpt.names())
    missing = sorted(expected - present)
    if missing:
        raise WeightLoadError(f"{ckpt.path}: missing {len(missing)} tensor(s) of a "
                              f"{codec.name} export, e.g. {missing[:3]}")
    kv_names = {f"model.layers.{i}.self_attn.{w}" for i in range(cfg.num_hidden_layers)
                for w in ("k_scale", "v_scale", "k_proj.k_scale", "v_proj.v_scale")}
    unexpected = sorted(present - expected - kv_names)
    if unexpected:
        raise WeightLoadError(f"{ckpt.path}: unexpected tensor(s) for this config and format, "
                              f"e.g. {unexpected[:3]}")

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
        if tuple(arr.shape) != shapes[name]:
            raise WeightLoadError(f"{ckpt.path}: {name} has shape {tuple(arr.shape)}, the config "
                                  f"says {shapes[name]}")
        if not (np.issubdtype(arr.dtype, np.floating) or arr.dtype.name == "bfloat16"):
            raise WeightLoadError(f"{ckpt.path}: {name} has dtype {arr.dtype}, expected a float")
        with torch.no_grad():
            params[name].copy_(to_torch(arr).to(dtype))
    for name in sorted(quantized):
        module = module_of(name)
        specs = codec.tensor_specs(shapes[name])
        parts = {}
        for suffix, spec in specs.items():
            _check_part(ckpt, f"{module}.{suffix}", spec)
            parts[suffix] = ckpt.get(f"{module}.{suffix}")
        _set_submodule(model, module, make_linear(recipe, parts, device).to(device))
    model.set_attention_impl(resolve_attention(recipe.attention, torch.device(device).type))
    return model.eval().requires_grad_(False), cfg


def _round_spec(recipe: Recipe, given: RoundWeights | None) -> RoundWeights | None:
    """The dial to apply: ``given``, else the recipe's ``round_weights`` (None, a ``RoundWeights``,
    a (bits, block_size) pair or a mapping of the two)."""
    spec = given if given is not None else getattr(recipe, "round_weights", None)
    if spec is None or isinstance(spec, RoundWeights):
        return spec
    if isinstance(spec, (tuple, list)):
        return RoundWeights(*spec)
    return RoundWeights(**dict(spec))


def load_model(path: str | os.PathLike, recipe: Recipe, *, device: str | torch.device = "cpu",
               require_manifest: bool = False, round_weights: RoundWeights | None = None) -> LoadedModel:
    """Verify (manifest when present or required) and load ``path`` for ``recipe``.

    ``round_weights`` (default: the recipe's, when it has one): round every quantizable linear of
    the loaded weights to symmetric per-block K-bit integers (``sampler_torch.recipes.rounding``),
    with scales from these weights -- every load, hence every reload, recomputes them.
    Raises ``WeightLoadError`` (bad or mismatched files) or ``RecipeError`` (the export is in
    another format than the recipe needs, or a dial the recipe cannot apply).
    """
    spec = _round_spec(recipe, round_weights)
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
                       v_scales=[s or 1.0 for s in v] if has_k else None, manifest=manifest)


__all__ = ["LoadedModel", "WeightLoadError", "load_model", "verify_export"]
