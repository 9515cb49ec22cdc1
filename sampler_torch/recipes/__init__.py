"""Precision recipes for the sampler: registry, quantized modules, KV caches, export loading.

See ``sampler_torch.recipes.registry`` for the table of recipes.
"""

from sampler_torch.recipes.kv_cache import ScaledFP8KVCache, make_kv_cache
from sampler_torch.recipes.loader import LoadedModel, WeightLoadError, load_model, verify_export
from sampler_torch.recipes.registry import (
    RECIPES,
    Recipe,
    RecipeError,
    get_recipe,
    kv_torch_dtype,
    register_recipe,
    resolve_attention,
    torch_dtype,
)

__all__ = ["RECIPES", "LoadedModel", "Recipe", "RecipeError", "ScaledFP8KVCache", "WeightLoadError",
           "get_recipe", "kv_torch_dtype", "load_model", "make_kv_cache", "register_recipe",
           "resolve_attention", "torch_dtype", "verify_export"]
