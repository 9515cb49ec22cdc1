"""Precision recipes: what a sampler group loads, how it quantizes activations, its KV dtype, kernels.

The table is torch-free and lives beside the wire (whose ``Recipe`` message carries it) because both
sides read it: the trainer validates recipe names when a config loads and publishes each group's
``weight_format``; the sampler (``sampler_torch.recipes``) implements the recipes.

A recipe is data, not code: the loader (``sampler_torch.recipes.loader``) reads the export a
recipe names and swaps the model's projections for the matching quantized modules
(``sampler_torch.recipes.linear``); the engine builds the KV cache the recipe names
(``sampler_torch.recipes.kv_cache``). Weights always come from the converter's export in the
recipe's ``weight_format``; nothing is re-quantized at load time.

===============  ============  ======================================================  ========
name             weight fmt    activations (per matmul)                                KV
===============  ============  ======================================================  ========
``bf16``         ``bf16``      compute dtype                                           auto
``fp8``          ``fp8_block`` e4m3, one scale per token per 128 inputs (dynamic)      auto
``nvfp4_w4a16``  ``nvfp4``     compute dtype (weights dequantized, Marlin-style)       auto
``nvfp4_w4a4``   ``nvfp4``     NVFP4: e2m1, e4m3 scale per 16 inputs, global           auto
                               ``input_scale`` from the export
``mxfp4_w4a16``  ``mxfp4``     compute dtype (weights dequantized)                     auto
``int8``         ``w8a8_int8`` int8, one scale per token (dynamic, symmetric)          auto
===============  ============  ======================================================  ========

Every recipe can be varied with ``get_recipe(name, kv_cache_dtype=..., attention=...,
compute_dtype=...)``: attention ``auto`` (the default) is chosen per device by
``resolve_attention`` (eager on the CPU, sdpa on CUDA); KV ``auto`` stores keys/values in the
compute dtype, ``bf16``, ``fp8_e4m3`` and ``fp8_e5m2`` store them in that dtype (fp8 with the
export's per-layer ``k_scale``/``v_scale``, else 1.0). ``compute_dtype="float32"`` is the
"fp32 mode" used to tie the sampler to the fp32 trainer: quantized values stay exactly what the
export holds, only the arithmetic around them is float32.

``logit_noise=sigma`` is the *mismatch dial*, a control for experiments rather than a precision:
the engine adds ``sigma * eps`` to the raw logits (before temperature) of every sampled token,
``eps`` standard normal per vocabulary entry, a pure function of the request's seed, the token's
index and the vocabulary id (``sampler_torch.engine.sampling.logit_noise``). Everything the
trajectory records (log b, log q, the head, the support) is of the perturbed distribution, the one
actually sampled from, so the trainer's correction sees an exact behaviour policy whose distance
from its own grows with sigma. The registered session's ``Recipe.logit_noise`` carries sigma, so
every trajectory's recipe says how it was perturbed. 0 (the default) is off.
"""

from __future__ import annotations

import dataclasses
import math

WEIGHT_FORMATS = ("bf16", "fp8_block", "nvfp4", "mxfp4", "w8a8_int8")
#: ``mixrl-sample --backend`` choice -> the label a registration's ``Recipe.backend`` carries
BACKENDS = {"engine": "mixrl-engine", "sglang": "sglang", "vllm": "vllm"}
ACTIVATIONS = ("none", "fp8_g128", "nvfp4", "int8_token")
KV_CACHE_DTYPES = ("auto", "bf16", "float32", "fp8_e4m3", "fp8_e5m2")
#: ``auto`` picks per device (``resolve_attention``): what the engine measured fastest there.
ATTENTION_IMPLS = ("auto", "sdpa", "eager")
COMPUTE_DTYPES = ("bfloat16", "float32")
#: how the quantized matmuls run: the hardware-style kernel where torch has one on this device
#: (``torch._scaled_mm`` for fp8, ``torch._int_mm`` for int8), or an exact float emulation
KERNELS = ("auto", "native", "emulate")

# Which activation schemes each weight format can pair with.
_COMPATIBLE = {
    "bf16": ("none",),
    "fp8_block": ("fp8_g128", "none"),
    "nvfp4": ("none", "nvfp4"),
    "mxfp4": ("none",),
    "w8a8_int8": ("int8_token", "none"),
}


class RecipeError(ValueError):
    """An unknown recipe, an inconsistent one, or an export that does not fit the recipe."""


def parse_round_weights(name: str, value) -> tuple[int, int] | None:
    """``round_weights`` as (bits, block_size): from None / "" (off), "K/B" text or a pair."""
    if value is None or value == "":
        return None
    parts = value.split("/") if isinstance(value, str) else list(value)
    try:
        bits, block = (int(p) for p in parts)
    except (TypeError, ValueError):
        raise RecipeError(f"recipe {name!r}: round_weights={value!r} is not BITS/BLOCK_SIZE") from None
    if not 2 <= bits <= 8 or block <= 0:
        raise RecipeError(f"recipe {name!r}: round_weights needs bits in 2..8 and block_size > 0, "
                          f"got {bits}/{block}")
    return bits, block


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str
    weight_format: str
    activations: str = "none"
    kv_cache_dtype: str = "auto"
    attention: str = "auto"
    compute_dtype: str = "bfloat16"
    kernel: str = "auto"
    logit_noise: float = 0.0  # sigma of the Gaussian logit perturbation (the mismatch dial)
    # The quantization-shaped dial: (bits, block_size) or None (off); "K/B" text from
    # ``--recipe-override round_weights=4/32`` (sampler_torch.recipes.rounding does the rounding).
    round_weights: tuple[int, int] | None = None

    def __post_init__(self):
        try:  # ``--recipe-override logit_noise=0.1`` arrives as text
            sigma = float(self.logit_noise)
        except (TypeError, ValueError):
            raise RecipeError(f"recipe {self.name!r}: logit_noise={self.logit_noise!r} is not a "
                              "number") from None
        if not math.isfinite(sigma) or sigma < 0:
            raise RecipeError(f"recipe {self.name!r}: logit_noise must be a finite sigma >= 0, "
                              f"got {self.logit_noise!r}")
        object.__setattr__(self, "logit_noise", sigma)
        object.__setattr__(self, "round_weights", parse_round_weights(self.name, self.round_weights))
        for field, allowed in (("weight_format", WEIGHT_FORMATS), ("activations", ACTIVATIONS),
                               ("kv_cache_dtype", KV_CACHE_DTYPES),
                               ("attention", ATTENTION_IMPLS), ("compute_dtype", COMPUTE_DTYPES),
                               ("kernel", KERNELS)):
            value = getattr(self, field)
            if value not in allowed:
                raise RecipeError(f"recipe {self.name!r}: {field}={value!r}, expected one of "
                                  f"{', '.join(allowed)}")
        if self.round_weights is not None and self.activations != "none":
            raise RecipeError(f"recipe {self.name!r}: round_weights needs float weights; "
                              f"activations {self.activations!r} run on quantized parts")
        if self.activations not in _COMPATIBLE[self.weight_format]:
            raise RecipeError(f"recipe {self.name!r}: activations {self.activations!r} do not go "
                              f"with {self.weight_format!r} weights")

    @property
    def kv_dtype_name(self) -> str:
        """The KV cache's element type by its torch / ml_dtypes name (``auto``: the compute dtype)."""
        return {"auto": self.compute_dtype, "bf16": "bfloat16", "float32": "float32",
                "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}[self.kv_cache_dtype]

    def describe(self) -> dict[str, str | float]:
        """The recipe as the trajectory metadata records it."""
        return dataclasses.asdict(self) | {"kv_cache_dtype": self.kv_dtype_name}


def resolve_attention(attention: str, device_type: str) -> str:
    """The attention implementation ``attention`` means on a ``device_type`` ("cpu", "cuda").

    ``sdpa`` and ``eager`` mean what they say everywhere; ``auto`` is ``eager`` on the CPU (the
    explicit float32 softmax beats torch's CPU SDPA kernels on decode-sized queries: 1.3-1.8x in
    ``benchmarks/bench_sampler.py``) and ``sdpa`` elsewhere (flash / memory-efficient kernels).
    """
    if attention not in ATTENTION_IMPLS:
        raise RecipeError(f"attention={attention!r}, expected one of {', '.join(ATTENTION_IMPLS)}")
    if attention != "auto":
        return attention
    return "eager" if device_type == "cpu" else "sdpa"


RECIPES: dict[str, Recipe] = {}


def register_recipe(recipe: Recipe, *, overwrite: bool = False) -> Recipe:
    if recipe.name in RECIPES and not overwrite:
        raise RecipeError(f"recipe {recipe.name!r} is already registered")
    RECIPES[recipe.name] = recipe
    return recipe


for _r in (
    Recipe("bf16", "bf16"),
    Recipe("fp8", "fp8_block", "fp8_g128"),
    Recipe("nvfp4_w4a16", "nvfp4"),
    Recipe("nvfp4_w4a4", "nvfp4", "nvfp4"),
    Recipe("mxfp4_w4a16", "mxfp4"),
    Recipe("int8", "w8a8_int8", "int8_token"),
):
    register_recipe(_r)


def get_recipe(recipe: str | Recipe, **overrides) -> Recipe:
    """A registered recipe by name (or a ``Recipe`` as is), with fields overridden.

    ``get_recipe("fp8", kv_cache_dtype="fp8_e4m3", attention="eager")``.
    """
    if isinstance(recipe, Recipe):
        base = recipe
    else:
        try:
            base = RECIPES[recipe]
        except KeyError:
            raise RecipeError(f"unknown recipe {recipe!r}; registered: "
                              f"{', '.join(RECIPES)}") from None
    if not overrides:
        return base
    unknown = set(overrides) - {f.name for f in dataclasses.fields(Recipe)}
    if unknown:
        raise RecipeError(f"unknown recipe field(s) {sorted(unknown)}")
    return dataclasses.replace(base, **overrides)
