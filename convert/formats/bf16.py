"""``bf16``: plain HF checkpoint, every tensor bfloat16.

``<module>.weight`` bf16 ``[out, in]``; no ``quantization_config``. Casting rounds to nearest
even. Loaded by every stack.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from convert.formats.base import Codec, TensorSpec
from convert.formats.numerics import BF16, as_matrix, check_finite, load_f32, to_bf16


class BF16Codec(Codec):
    name = "bf16"
    parts = ("weight",)

    def quantize(self, w: np.ndarray, *, what: str = "tensor") -> dict[str, np.ndarray]:
        w = as_matrix(w, what)
        check_finite(w, what)
        return {"weight": to_bf16(w)}

    def dequantize(self, parts: Mapping[str, np.ndarray]) -> np.ndarray:
        return load_f32(np.asarray(parts["weight"]))

    def tensor_specs(self, shape: tuple[int, int]) -> dict[str, TensorSpec]:
        return {"weight": (BF16, tuple(shape))}

    @classmethod
    def matches(cls, quantization_config: Mapping | None) -> bool:
        return not quantization_config
