"""``mxfp4``: OCP Microscaling MXFP4 (e2m1 elements, one E8M0 power-of-two scale per 32).

Tensors per linear ``W [out, in]`` (``in`` even):

- ``<module>.weight``: uint8 ``[out, in/2]``, two e2m1 codes per byte, element ``2j`` in the
  low nibble (the nibble order of gpt-oss' ``*_blocks`` and of NVFP4)
- ``<module>.weight_scale``: uint8 ``[out, ceil(in/32)]``, E8M0 codes (biased exponent, bias
  127; 255 = NaN is never written)

For ``in % 32 == 0`` this is exactly gpt-oss' ``<name>_blocks`` ``[out, in/32, 16]`` and
``<name>_scales`` ``[out, in/32]`` reshaped; the flat names keep one layout for every linear.

Dequantization: ``W[i, j] ~= e2m1(weight)[i, j] * 2 ** (weight_scale[i, j // 32] - 127)``.

Quantization per OCP MX v1.0 section 6.3: ``shared_exp = floor(log2(amax(|group|))) - 2`` (2 =
e2m1's max exponent), clamped to [-127, 127] (an all-zero group gets -127); elements
``e2m1(x / 2**shared_exp)``, round-to-nearest-even, saturating at +-6 (values whose scaled
magnitude lies in (6, 8) clip to 6, as the spec prescribes).

``config.json``: ``{"quant_method": "mxfp4", "modules_to_not_convert": [...],
"weight_block_size": 32, "layout": "weight/weight_scale"}``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from convert.formats.base import Codec, TensorSpec
from convert.formats.fp4_tiles import ceil_div, check_even, expand_groups, group_amax, quantize_groups
from convert.formats.numerics import (
    QuantizationError,
    as_matrix,
    check_finite_amax,
    decode_e2m1,
    decode_e8m0,
    unpack_nibbles,
)

GROUP = 32
E2M1_EMAX = 2


class MXFP4Codec(Codec):
    name = "mxfp4"
    parts = ("weight", "weight_scale")
    serving_multiple = (1, GROUP)
    serving_reason = "MXFP4 kernels (and gpt-oss' _blocks layout) take whole 32-blocks"

    def quantize(self, w: np.ndarray, *, what: str = "tensor") -> dict[str, np.ndarray]:
        w = as_matrix(w, what)
        check_even(w.shape, self.name, what)
        bad: list[bool] = []

        def scales(grouped: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            amax = group_amax(grouped)
            if not np.isfinite(amax).all():
                bad.append(True)
                amax = np.nan_to_num(amax, nan=0.0, posinf=0.0)
            # frexp: amax = m * 2**e with m in [0.5, 1), so floor(log2(amax)) = e - 1, exactly.
            _, e = np.frexp(amax)
            shared = np.clip(e - 1 - E2M1_EMAX, -127, 127)
            shared[amax == 0] = -127
            return np.ldexp(np.float32(1.0), shared).astype(np.float32), (shared + 127).astype(
                np.uint8)

        packed, scale_codes = quantize_groups(w, GROUP, np.dtype(np.uint8), scales)
        if bad:
            check_finite_amax(np.array([np.nan]), what)
        return {"weight": packed, "weight_scale": scale_codes}

    def dequantize(self, parts: Mapping[str, np.ndarray]) -> np.ndarray:
        packed, scale = np.asarray(parts["weight"]), np.asarray(parts["weight_scale"])
        n_out, n_in = packed.shape[0], packed.shape[1] * 2
        if packed.dtype != np.uint8 or scale.shape != (n_out, ceil_div(n_in, GROUP)):
            raise QuantizationError(f"mxfp4: weight {packed.dtype}{packed.shape} and "
                                    f"weight_scale {scale.shape} do not match")
        return decode_e2m1(unpack_nibbles(packed)) * expand_groups(decode_e8m0(scale), GROUP,
                                                                   n_in)

    def tensor_specs(self, shape: tuple[int, int]) -> dict[str, TensorSpec]:
        n_out, n_in = shape
        u8 = np.dtype(np.uint8)
        return {"weight": (u8, (n_out, n_in // 2)),
                "weight_scale": (u8, (n_out, ceil_div(n_in, GROUP)))}

    def quantization_config(self, ignore: list[str], *, kv_cache_fp8: bool = False) -> dict:
        return {"quant_method": "mxfp4", "weight_block_size": GROUP,
                "layout": "weight/weight_scale", "modules_to_not_convert": list(ignore)}

    @classmethod
    def matches(cls, quantization_config: Mapping | None) -> bool:
        return bool(quantization_config) and quantization_config.get("quant_method") == "mxfp4"
