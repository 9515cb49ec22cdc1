"""The sampler's view of the precision recipes: the torch dtypes a recipe names.

The recipe table itself (names, weight formats, activation schemes, KV dtypes) is torch-free and
lives in ``mixrl_wire.recipes``, because the trainer validates and publishes by it too.
"""

from __future__ import annotations

import torch

from mixrl_wire.recipes import (
    ACTIVATIONS,
    ATTENTION_IMPLS,
    COMPUTE_DTYPES,
    KERNELS,
    KV_CACHE_DTYPES,
    RECIPES,
    WEIGHT_FORMATS,
    Recipe,
    RecipeError,
    get_recipe,
    register_recipe,
    resolve_attention,
)


def torch_dtype(recipe: Recipe) -> torch.dtype:
    """The dtype the recipe computes in."""
    return getattr(torch, recipe.compute_dtype)


def kv_torch_dtype(recipe: Recipe) -> torch.dtype:
    """The dtype the recipe's KV cache stores keys and values in."""
    return getattr(torch, recipe.kv_dtype_name)


__all__ = ["ACTIVATIONS", "ATTENTION_IMPLS", "COMPUTE_DTYPES", "KERNELS", "KV_CACHE_DTYPES", "RECIPES",
           "WEIGHT_FORMATS", "Recipe", "RecipeError", "get_recipe", "kv_torch_dtype", "register_recipe",
           "resolve_attention", "torch_dtype"]
