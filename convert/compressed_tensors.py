"""The compressed-tensors layout: vLLM's and llm-compressor's native checkpoint format, as an
export layout for the formats it covers (``export_hf(..., layout="compressed-tensors")``,
``mixrl-convert quantize --layout compressed-tensors``).

Same quantized values as the native codecs (the same scale rules, ``convert/README.md``); only
names, scale conventions and the config differ. Per linear ``W [out, in]``:

==============  =====================  ====================================================
scheme          compressed format      tensors
==============  =====================  ====================================================
``fp8_channel`` ``float-quantized``    ``weight`` F8_E4M3 ``[out,in]``, ``weight_scale`` F32
                                       ``[out,1]`` (``amax/448`` per row)
``fp8_block``   ``float-quantized``    ``weight`` F8_E4M3, ``weight_scale`` F32
                                       ``[ceil(out/128),ceil(in/128)]`` (block strategy)
``w8a8_int8``   ``int-quantized``      ``weight`` I8, ``weight_scale`` F32 ``[out,1]``
``nvfp4``       ``nvfp4-pack-          ``weight_packed`` U8 ``[out,in/2]`` (low nibble = even
                quantized``            element), ``weight_scale`` F8_E4M3 ``[out,in/16]``,
                                       ``weight_global_scale`` F32 ``[1]``,
                                       ``input_global_scale`` F32 ``[1]``
==============  =====================  ====================================================

Dequantization is the library's: ``q * scale`` (per row or block), and for NVFP4
``e2m1 * (weight_scale / weight_global_scale)`` -- the global scale is the reciprocal of
ModelOpt's ``weight_scale_2`` (and ``input_global_scale`` of its ``input_scale``).

``config.json`` ``quantization_config``::

    {"quant_method": "compressed-tensors", "format": F, "quantization_status": "compressed",
     "config_groups": {"group_0": {"targets": ["Linear"], "weights": {...},
                                   "input_activations": {...}, "format": F}},
     "ignore": [...], "kv_cache_scheme": null | {8-bit float, per tensor, static}}

FP8 KV-cache scales keep their names (``self_attn.k_scale`` / ``v_scale``), which vLLM reads for
a ``kv_cache_scheme``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from convert.formats.base import Codec, TensorSpec
from convert.formats.fp4_tiles import ceil_div, expand_groups
from convert.formats.fp8_block import BLOCK, FP8BlockCodec
from convert.formats.numerics import (
    E4M3,
    E4M3_MAX,
    QuantizationError,
    as_matrix,
    check_finite,
    decode_e2m1,
    decode_e4m3,
    encode_e4m3,
    load_f32,
    unpack_nibbles,
)
from convert.formats.nvfp4 import GROUP as NVFP4_GROUP
from convert.formats.nvfp4 import NVFP4Codec
from convert.formats.w8a8_int8 import W8A8Int8Codec

LAYOUT = "compressed-tensors"
LAYOUTS = ("native", LAYOUT)
F32 = np.dtype(np.float32)

_FP8_ARGS = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
_INT8_ARGS = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False}


class CompressedTensorsCodec(Codec):
    """A scheme of the compressed-tensors layout (``name`` is the weight format it carries)."""

    layout = LAYOUT
    #: the compressed-tensors ``format`` of the scheme
    ct_format: str
    weights: dict
    input_activations: dict

    def quantization_config(self, ignore: list[str], *, kv_cache_fp8: bool = False) -> dict:
        kv = ({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
               "symmetric": True} if kv_cache_fp8 else None)
        return {"quant_method": "compressed-tensors", "format": self.ct_format,
                "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": self.weights,
                                              "input_activations": self.input_activations,
                                              "format": self.ct_format}},
                "ignore": list(ignore), "kv_cache_scheme": kv}

    @classmethod
    def matches(cls, quantization_config: Mapping | None) -> bool:
        if not quantization_config or quantization_config.get("quant_method") != \
                "compressed-tensors":
            return False
        groups = list((quantization_config.get("config_groups") or {}).values())
        return len(groups) == 1 and groups[0].get("format", quantization_config.get(
            "format")) == cls.ct_format and _same(groups[0].get("weights") or {}, cls.weights)


def _same(got: Mapping, want: Mapping) -> bool:
    return all(got.get(k) == v for k, v in want.items() if k != "dynamic")


class CTFP8Channel(CompressedTensorsCodec):
    name = "fp8_channel"
    parts = ("weight", "weight_scale")
    ct_format = "float-quantized"
    weights = {**_FP8_ARGS, "strategy": "channel"}
    input_activations = {**_FP8_ARGS, "strategy": "token", "dynamic": True}

    def quantize(self, w: np.ndarray, *, what: str = "tensor") -> dict[str, np.ndarray]:
        x = load_f32(as_matrix(w, what))
        check_finite(x, what)
        s = np.abs(x).max(axis=1, keepdims=True) / np.float32(E4M3_MAX)
        s[s == 0] = 1.0
        return {"weight": encode_e4m3(x / s).view(E4M3), "weight_scale": s.astype(np.float32)}

    def dequantize(self, parts: Mapping[str, np.ndarray]) -> np.ndarray:
        q, s = np.asarray(parts["weight"]), np.asarray(parts["weight_scale"], np.float32)
        if q.ndim != 2 or s.shape != (q.shape[0], 1):
            raise QuantizationError(f"fp8_channel: weight {q.shape} and weight_scale {s.shape} "
                                    "do not match")
        return decode_e4m3(q) * s

    def tensor_specs(self, shape: tuple[int, int]) -> dict[str, TensorSpec]:
        return {"weight": (E4M3, tuple(shape)), "weight_scale": (F32, (shape[0], 1))}


class CTFP8Block(CompressedTensorsCodec):
    name = "fp8_block"
    parts = ("weight", "weight_scale")
    ct_format = "float-quantized"
    weights = {**_FP8_ARGS, "strategy": "block", "block_structure": [BLOCK, BLOCK]}
    input_activations = {**_FP8_ARGS, "strategy": "group", "group_size": BLOCK, "dynamic": True}
    serving_multiple = FP8BlockCodec.serving_multiple
    serving_reason = FP8BlockCodec.serving_reason

    def quantize(self, w: np.ndarray, *, what: str = "tensor") -> dict[str, np.ndarray]:
        parts = FP8BlockCodec().quantize(w, what=what)
        return {"weight": parts["weight"], "weight_scale": parts["weight_scale_inv"]}

    def dequantize(self, parts: Mapping[str, np.ndarray]) -> np.ndarray:
        return FP8BlockCodec().dequantize({"weight": parts["weight"],
                                           "weight_scale_inv": parts["weight_scale"]})

    def tensor_specs(self, shape: tuple[int, int]) -> dict[str, TensorSpec]:
        specs = FP8BlockCodec().tensor_specs(shape)
        return {"weight": specs["weight"], "weight_scale": specs["weight_scale_inv"]}


class CTInt8(CompressedTensorsCodec):
    name = "w8a8_int8"
    parts = ("weight", "weight_scale")
    ct_format = "int-quantized"
    weights = {**_INT8_ARGS, "strategy": "channel"}
    input_activations = {**_INT8_ARGS, "strategy": "token", "dynamic": True}
    serving_multiple = W8A8Int8Codec.serving_multiple
    serving_reason = W8A8Int8Codec.serving_reason

    def quantize(self, w: np.ndarray, *, what: str = "tensor") -> dict[str, np.ndarray]:
        return W8A8Int8Codec().quantize(w, what=what)  # the same tensors, another config

    def dequantize(self, parts: Mapping[str, np.ndarray]) -> np.ndarray:
        return W8A8Int8Codec().dequantize(parts)

    def tensor_specs(self, shape: tuple[int, int]) -> dict[str, TensorSpec]:
        return W8A8Int8Codec().tensor_specs(shape)


class CTNVFP4(CompressedTensorsCodec):
    name = "nvfp4"
    parts = ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")
    ct_format = "nvfp4-pack-quantized"
    weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group",
               "group_size": NVFP4_GROUP, "symmetric": True, "dynamic": False}
    input_activations = {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                         "group_size": NVFP4_GROUP, "symmetric": True, "dynamic": "local"}
    serving_multiple = NVFP4Codec.serving_multiple
    serving_reason = NVFP4Codec.serving_reason
    calibrated_inputs = True

    def quantize(self, w: np.ndarray, *, what: str = "tensor",
                 input_amax: float | None = None) -> dict[str, np.ndarray]:
        parts = NVFP4Codec().quantize(w, what=what, input_amax=input_amax)
        one = np.float32(1.0)
        return {"weight_packed": parts["weight"], "weight_scale": parts["weight_scale"],
                "weight_global_scale": (one / parts["weight_scale_2"]).reshape(1),
                "input_global_scale": (one / parts["input_scale"]).reshape(1)}

    def dequantize(self, parts: Mapping[str, np.ndarray]) -> np.ndarray:
        packed = np.asarray(parts["weight_packed"])
        scale = np.asarray(parts["weight_scale"])
        glob = np.asarray(parts["weight_global_scale"], np.float32).reshape(())
        n_out, n_in = packed.shape[0], packed.shape[1] * 2
        if packed.dtype != np.uint8 or scale.shape != (n_out, ceil_div(n_in, NVFP4_GROUP)):
            raise QuantizationError(f"nvfp4 (compressed-tensors): weight_packed "
                                    f"{packed.dtype}{packed.shape} and weight_scale {scale.shape} "
                                    "do not match")
        # The library's order: scale / global first, then times the e2m1 value.
        group_scale = decode_e4m3(scale) / glob
        return decode_e2m1(unpack_nibbles(packed)) * expand_groups(group_scale, NVFP4_GROUP, n_in)

    def tensor_specs(self, shape: tuple[int, int]) -> dict[str, TensorSpec]:
        n_out, n_in = shape
        return {"weight_packed": (np.dtype(np.uint8), (n_out, n_in // 2)),
                "weight_scale": (E4M3, (n_out, ceil_div(n_in, NVFP4_GROUP))),
                "weight_global_scale": (F32, (1,)), "input_global_scale": (F32, (1,))}


SCHEMES: dict[str, CompressedTensorsCodec] = {c.name: c for c in (
    CTFP8Channel(), CTFP8Block(), CTInt8(), CTNVFP4())}


def get_scheme(fmt: str) -> CompressedTensorsCodec:
    """The compressed-tensors scheme carrying weight format ``fmt``."""
    try:
        return SCHEMES[fmt]
    except KeyError:
        raise ValueError(f"the {LAYOUT} layout covers {', '.join(SCHEMES)}, not {fmt!r}") from None


__all__ = ["LAYOUT", "LAYOUTS", "SCHEMES", "CompressedTensorsCodec", "get_scheme"]
