"""The quantization-shaped mismatch dial: ``round_weights: {bits: K, block_size: B}``.

Unlike ``logit_noise`` (fresh noise per request seed and position, independent of the context), a
sampler with ``round_weights`` serves a model whose every quantizable linear (the projections a
weight format quantizes: attention q/k/v/o, MLP gate/up/down, MoE experts; never embeddings,
``lm_head``, norms or routers, ``convert.formats.base.is_quantized_weight``) is rounded to
symmetric per-block K-bit integers:

    for each output row and each block of B consecutive inputs (the last block of a row may be
    shorter when B does not divide the input size):
        scale = max |w| / (2^(K-1) - 1)      (an all-zero block keeps scale 0 and stays 0)
        w'    = clamp(round(w / scale), -(2^(K-1) - 1), 2^(K-1) - 1) * scale

(round to nearest, ties to even; arithmetic in float32, the result cast back to the weight's
dtype). The error is fixed for a loaded version and a context, systematic, and grows as K falls --
the shape of real weight quantization. The scales are recomputed from every loaded version
(``sampler_torch.recipes.loader.load_model`` applies it at each load, so at every reload).

Where in the recipe: *after* the recipe's own weight handling, on the weights the sampler computes
with -- the plain linears of a ``bf16`` export, or the dequantized weights of a weight-only recipe
(``nvfp4_w4a16``, ``mxfp4_w4a16``). A recipe that quantizes activations runs its own kernel on its
stored integer/fp8 parts, which have no float weight to round: refused (``check_recipe``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from convert.formats.base import is_quantized_weight
from sampler_torch.recipes.linear import DequantLinear, QuantLinear
from sampler_torch.recipes.registry import Recipe, RecipeError

BITS = range(2, 9)  # 2..8


@dataclasses.dataclass(frozen=True)
class RoundWeights:
    """K bits (2..8), B inputs per block (> 0; a shorter tail block when B does not divide)."""

    bits: int
    block_size: int

    def __post_init__(self) -> None:
        for name in ("bits", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise RecipeError(f"round_weights.{name} must be an integer, got {value!r}")
        if self.bits not in BITS:
            raise RecipeError(f"round_weights.bits must be in 2..8, got {self.bits}")
        if self.block_size <= 0:
            raise RecipeError(f"round_weights.block_size must be > 0, got {self.block_size}")

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1


def round_blockwise(weight: torch.Tensor, spec: RoundWeights) -> torch.Tensor:
    """``weight`` [out, in] rounded as the module docstring says (a new tensor, same dtype)."""
    if weight.ndim != 2:
        raise ValueError(f"round_blockwise needs a [out, in] weight, got shape {tuple(weight.shape)}")
    out_f, in_f = weight.shape
    b = spec.block_size
    blocks = -(-in_f // b)
    w = weight.detach().float()
    # Pad the tail block with zeros: they change no block's max |w| and are cut off again.
    padded = torch.zeros(out_f, blocks * b, dtype=torch.float32, device=w.device)
    padded[:, :in_f] = w
    tiles = padded.view(out_f, blocks, b)
    scale = tiles.abs().amax(-1, keepdim=True) / spec.qmax
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(tiles / safe), -spec.qmax, spec.qmax)
    rounded = torch.where(scale > 0, q * scale, torch.zeros_like(tiles))
    return rounded.view(out_f, blocks * b)[:, :in_f].to(weight.dtype)


def round_spec(recipe: Recipe, given: RoundWeights | None = None) -> RoundWeights | None:
    """The dial to apply: ``given``, else the recipe's ``round_weights`` (None, a ``RoundWeights``,
    a (bits, block_size) pair or a mapping of the two)."""
    spec = given if given is not None else getattr(recipe, "round_weights", None)
    if spec is None or isinstance(spec, RoundWeights):
        return spec
    if isinstance(spec, (tuple, list)):
        return RoundWeights(*spec)
    return RoundWeights(**dict(spec))


def with_round_weights(recipe: Recipe, spec: RoundWeights) -> Recipe:
    """``recipe`` carrying ``round_weights`` (``load_model`` reads it off the recipe), for an
    ``Engine(path, recipe)`` that rounds at every load and reload (what ``--recipe-override
    round_weights=K/B`` gives a spawned sampler)."""
    check_recipe(recipe)
    return dataclasses.replace(recipe, round_weights=(spec.bits, spec.block_size))


def check_recipe(recipe: Recipe) -> None:
    """Refuse a recipe whose matmuls run on quantized activations (no float weight to round)."""
    if recipe.activations != "none":
        raise RecipeError(f"round_weights needs a recipe that computes with float weights (bf16, "
                          f"nvfp4_w4a16, mxfp4_w4a16); {recipe.name!r} quantizes activations "
                          f"({recipe.activations})")


def rounds(name: str, module: nn.Module) -> bool:
    """Whether the dial rounds module ``name`` (a quantizable linear with a float weight).

    Raises ``RecipeError`` on a quantized-activation module (``check_recipe`` refuses those
    recipes before any load)."""
    if not is_quantized_weight(f"{name}.weight"):
        return False
    if isinstance(module, (nn.Linear, DequantLinear)):
        return True
    if isinstance(module, QuantLinear):
        raise RecipeError(f"round_weights: {name} is a {type(module).__name__}, which runs on "
                          "quantized activations and has no float weight to round")
    return False


def round_model_weights(model: nn.Module, spec: RoundWeights) -> list[str]:
    """Round every quantizable linear of ``model`` in place; returns the modules rounded.

    Raises ``RecipeError`` on a quantized-activation module and ``ValueError`` when the model has
    no quantizable linear at all.
    """
    done = []
    with torch.no_grad():
        for name, module in model.named_modules():
            if rounds(name, module):
                module.weight.copy_(round_blockwise(module.weight, spec))
                done.append(name)
    if not done:
        raise ValueError("round_weights: the model has no quantizable linear to round")
    return done


__all__ = ["RoundWeights", "check_recipe", "round_blockwise", "round_model_weights", "round_spec", "rounds",
           "with_round_weights"]
