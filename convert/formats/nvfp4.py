"""``nvfp4``: NVIDIA FP4 in the ModelOpt unified-checkpoint layout (what SGLang's and vLLM's
``modelopt_fp4`` loaders read).

Tensors per linear ``W [out, in]`` (``in`` even; serving kernels need ``in % 16 == 0``):

- ``<module>.weight``: uint8 ``[out, in/2]``, two e2m1 codes per byte, element ``2j`` in the
  low nibble, ``2j+1`` in the high nibble
- ``<module>.weight_scale``: float8_e4m3fn ``[out, ceil(in/16)]``, one per group of 16 inputs
- ``<module>.weight_scale_2``: float32 scalar (shape ``[]``), the per-tensor global scale
- ``<module>.input_scale``: float32 scalar, the activations' global scale

Dequantization: ``W[i, j] ~= e2m1(weight)[i, j] * (float(weight_scale[i, j // 16]) *
weight_scale_2)``.

Scales as ModelOpt chooses them (``NVFP4QTensor``): ``weight_scale_2 = amax(|W|) / (6 * 448)``;
per group ``weight_scale = e4m3((amax(|group|) / 6) / weight_scale_2)`` (1.0 for an all-zero
group); codes ``e2m1(x / (float(weight_scale) * weight_scale_2))``, round-to-nearest-even,
saturating at +-6 (the e4m3 rounding of the group scale can push a value up to 6.4). A group
whose scale underflows e4m3 to zero (group amax below ~2e-6 of the tensor amax) encodes as
zeros. ``input_scale`` is ``activation_amax / (6 * 448)`` when a calibrated activation max is
given, else 1.0 (activations up to 2688 representable; our default without calibration).

``config.json`` ``quantization_config`` (the flat form newer SGLang/vLLM read)::

    {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
     "kv_cache_quant_algo": null | "FP8", "ignore": [...], "exclude_modules": [...]}

plus ``hf_quant_config.json`` (the nested form older loaders read)::

    {"producer": {"name": "modelopt", ...},
     "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": ..., "group_size": 16,
                      "exclude_modules": [...]}}
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from convert.formats.base import Codec, TensorSpec
from convert.formats.fp4_tiles import (
    ceil_div,
    check_even,
    expand_groups,
    group_amax,
    quantize_groups,
    tensor_amax,
)
from convert.formats.numerics import (
    E2M1_MAX,
    E4M3,
    E4M3_MAX,
    QuantizationError,
    as_matrix,
    check_finite_amax,
    decode_e2m1,
    decode_e4m3,
    encode_e4m3,
    unpack_nibbles,
)

GROUP = 16
HF_QUANT_CONFIG = "hf_quant_config.json"
PRODUCER = {"name": "modelopt", "version": "0.29.0", "note": "written by mixrl convert"}


class NVFP4Codec(Codec):
    name = "nvfp4"
    parts = ("weight", "weight_scale", "weight_scale_2", "input_scale")
    serving_multiple = (1, GROUP)
    serving_reason = "the NVFP4 GEMMs of vLLM/SGLang (CUTLASS, FlashInfer) take whole 16-groups"
    calibrated_inputs = True

    def quantize(self, w: np.ndarray, *, what: str = "tensor",
                 input_amax: float | None = None) -> dict[str, np.ndarray]:
        w = as_matrix(w, what)
        check_even(w.shape, self.name, what)
        amax = np.float32(tensor_amax(w))
        check_finite_amax(amax, what)
        scale_2 = amax / np.float32(E2M1_MAX * E4M3_MAX) if amax > 0 else np.float32(1.0)

        def scales(grouped: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            per_block = group_amax(grouped) / np.float32(E2M1_MAX)
            rel = per_block / scale_2
            rel[per_block == 0] = 1.0
            codes = encode_e4m3(rel)
            divisor = decode_e4m3(codes) * scale_2
            divisor[divisor == 0] = np.inf  # underflowed group scale: codes become (signed) 0
            return divisor, codes

        packed, scale_codes = quantize_groups(w, GROUP, np.dtype(np.uint8), scales)
        if input_amax is not None and not (np.isfinite(input_amax) and input_amax > 0):
            raise QuantizationError(f"{what}: input_amax must be a positive number, "
                                    f"got {input_amax}")
        input_scale = (np.float32(input_amax) / np.float32(E2M1_MAX * E4M3_MAX)
                       if input_amax is not None else np.float32(1.0))
        return {"weight": packed, "weight_scale": scale_codes.view(E4M3),
                "weight_scale_2": np.asarray(scale_2, np.float32).reshape(()),
                "input_scale": np.asarray(input_scale, np.float32).reshape(())}

    def dequantize(self, parts: Mapping[str, np.ndarray]) -> np.ndarray:
        packed = np.asarray(parts["weight"])
        scale = np.asarray(parts["weight_scale"])
        scale_2 = np.float32(np.asarray(parts["weight_scale_2"], np.float32).reshape(()))
        n_out, n_in = packed.shape[0], packed.shape[1] * 2
        if packed.dtype != np.uint8 or scale.shape != (n_out, ceil_div(n_in, GROUP)):
            raise QuantizationError(f"nvfp4: weight {packed.dtype}{packed.shape} and "
                                    f"weight_scale {scale.shape} do not match")
        values = decode_e2m1(unpack_nibbles(packed))
        group_scale = decode_e4m3(scale) * scale_2
        return values * expand_groups(group_scale, GROUP, n_in)

    def tensor_specs(self, shape: tuple[int, int]) -> dict[str, TensorSpec]:
        n_out, n_in = shape
        f32 = np.dtype(np.float32)
        return {"weight": (np.dtype(np.uint8), (n_out, n_in // 2)),
                "weight_scale": (E4M3, (n_out, ceil_div(n_in, GROUP))),
                "weight_scale_2": (f32, ()), "input_scale": (f32, ())}

    def quantization_config(self, ignore: list[str], *, kv_cache_fp8: bool = False) -> dict:
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": GROUP,
                "kv_cache_quant_algo": "FP8" if kv_cache_fp8 else None,
                "ignore": list(ignore), "exclude_modules": list(ignore), "producer": PRODUCER}

    def extra_files(self, ignore: list[str], *, kv_cache_fp8: bool = False) -> dict[str, dict]:
        return {HF_QUANT_CONFIG: {
            "producer": PRODUCER,
            "quantization": {"quant_algo": "NVFP4",
                             "kv_cache_quant_algo": "FP8" if kv_cache_fp8 else None,
                             "group_size": GROUP, "exclude_modules": list(ignore)}}}

    @classmethod
    def matches(cls, quantization_config: Mapping | None) -> bool:
        return bool(quantization_config) and \
            quantization_config.get("quant_method") == "modelopt" and \
            quantization_config.get("quant_algo") == "NVFP4"
