"""``w8a8_int8``: int8 weights with one float32 scale per output channel (SGLang ``w8a8_int8``;
activations are quantized per token at run time, so nothing else is stored).

Tensors per linear ``W [out, in]``:

- ``<module>.weight``: int8 ``[out, in]``
- ``<module>.weight_scale``: float32 ``[out, 1]``

Dequantization: ``W[i, j] ~= weight[i, j] * weight_scale[i, 0]``.

Quantization (symmetric): ``s_i = amax(|W[i, :]|) / 127`` (1.0 for an all-zero row),
``weight = clip(rint(W / s), -127, 127)`` with round-half-to-even; -128 is never used, so the
range is symmetric. int8 has no negative zero: ``-0.0`` comes back as ``+0.0``.

``config.json``: ``{"quant_method": "w8a8_int8", "ignore": [...]}`` (SGLang reads only the method;
its Qwen MoE router is built unquantized).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from convert.formats.base import Codec, TensorSpec
from convert.formats.numerics import (
    QuantizationError,
    as_matrix,
    check_finite_amax,
    load_f32,
    parallel_map,
    scratch,
)

QMAX = 127


class W8A8Int8Codec(Codec):
    name = "w8a8_int8"
    parts = ("weight", "weight_scale")
    serving_multiple = (8, 16)
    serving_reason = ("SGLang's int8_scaled_mm (CUTLASS) checks in % 16 and out % 8 for memory "
                      "alignment")

    def quantize(self, w: np.ndarray, *, what: str = "tensor") -> dict[str, np.ndarray]:
        w = as_matrix(w, what)
        n_out, n_in = w.shape
        q = np.empty((n_out, n_in), np.int8)
        scale = np.empty((n_out, 1), np.float32)
        band = max(1, (1 << 17) // n_in)  # whole rows, ~512 KiB of float32 per task
        bad: list[bool] = []

        def run(r0: int) -> None:
            r1 = min(n_out, r0 + band)
            x = load_f32(w[r0:r1], out=scratch("int8_band", (r1 - r0, n_in), np.float32))
            amax = np.maximum(x.max(axis=1), -x.min(axis=1))
            if not np.isfinite(amax).all():
                bad.append(True)
                return
            s = amax / np.float32(QMAX)
            s[amax == 0] = 1.0
            np.divide(x, s[:, None], out=x)
            np.rint(x, out=x)
            np.clip(x, -QMAX, QMAX, out=x)  # |x/s| <= 127 up to float32 rounding
            q[r0:r1] = x
            scale[r0:r1, 0] = s

        parallel_map(run, range(0, n_out, band))
        if bad:
            check_finite_amax(np.array([np.nan]), what)
        return {"weight": q, "weight_scale": scale}

    def dequantize(self, parts: Mapping[str, np.ndarray]) -> np.ndarray:
        q, s = np.asarray(parts["weight"]), np.asarray(parts["weight_scale"], np.float32)
        if q.dtype != np.int8 or s.shape != (q.shape[0], 1):
            raise QuantizationError(f"w8a8_int8: weight {q.dtype}{q.shape} and weight_scale "
                                    f"{s.shape} do not match")
        return q.astype(np.float32) * s

    def tensor_specs(self, shape: tuple[int, int]) -> dict[str, TensorSpec]:
        n_out, n_in = shape
        return {"weight": (np.dtype(np.int8), (n_out, n_in)),
                "weight_scale": (np.dtype(np.float32), (n_out, 1))}

    def quantization_config(self, ignore: list[str], *, kv_cache_fp8: bool = False) -> dict:
        return {"quant_method": "w8a8_int8", "ignore": list(ignore)}

    @classmethod
    def matches(cls, quantization_config: Mapping | None) -> bool:
        return bool(quantization_config) and \
            quantization_config.get("quant_method") == "w8a8_int8"

