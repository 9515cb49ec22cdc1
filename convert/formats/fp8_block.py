"""``fp8_block``: float8_e4m3fn weights with one float32 scale per 128x128 block (DeepSeek-V3 /
Qwen3-FP8 layout).

Tensors per linear ``W [out, in]``:

- ``<module>.weight``: float8_e4m3fn ``[out, in]``
- ``<module>.weight_scale_inv``: float32 ``[ceil(out/128), ceil(in/128)]``

Despite its name (kept for compatibility), ``weight_scale_inv`` is the dequantization
multiplier: ``W[i, j] ~= float(weight[i, j]) * weight_scale_inv[i // 128, j // 128]``.
Edge blocks are partial (the last row/column block covers what is left).

Quantization, per block ``B``: ``s = amax(|B|) / 448`` in float32 (``s = 1`` for an all-zero
block, whose codes are then exactly zero), ``weight = e4m3(B / s)`` with round-to-nearest-even
(the block max maps to +-448; float32 rounding can put it a hair above, which saturates).

``config.json``::

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
      "activation_scheme": "dynamic", "weight_block_size": [128, 128],
      "modules_to_not_convert": [...], "ignored_layers": [...]}

``modules_to_not_convert`` is what transformers' FineGrainedFP8 reads, ``ignored_layers`` what
SGLang's/vLLM's ``Fp8Config`` read (the same list). Serving shapes: both dimensions multiples of
128 (``convert.formats.base.shape_exclusions`` keeps other projections in bf16). Loaded by SGLang/vLLM (block
FP8 GEMM on Hopper+, Marlin on Ampere) and by transformers (dequantized to bf16 on CPU).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from convert.formats.base import Codec, TensorSpec
from convert.formats.numerics import (
    E4M3,
    E4M3_MAX,
    QuantizationError,
    as_matrix,
    check_finite_amax,
    decode_e4m3,
    encode_e4m3,
    load_f32,
    parallel_map,
    scratch,
)

BLOCK = 128
# Columns per tile: 128 x 1024 float32 is 512 KiB, so the tile and its scratch stay in L2.
TILE_COLS = 1024


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class FP8BlockCodec(Codec):
    name = "fp8_block"
    parts = ("weight", "weight_scale_inv")
    serving_multiple = (BLOCK, BLOCK)
    serving_reason = ("vLLM/SGLang block-FP8 layers need whole 128x128 blocks per fused shard; "
                      "transformers splits the weight evenly over its scale grid")

    def quantize(self, w: np.ndarray, *, what: str = "tensor") -> dict[str, np.ndarray]:
        w = as_matrix(w, what)
        n_out, n_in = w.shape
        n_rb, n_cb = _ceil_div(n_out, BLOCK), _ceil_div(n_in, BLOCK)
        codes = np.empty((n_out, n_in), np.uint8)
        scales = np.empty((n_rb, n_cb), np.float32)
        bad: list[int] = []

        def band(rb: int) -> None:
            r0, r1 = rb * BLOCK, min(n_out, (rb + 1) * BLOCK)
            rows = r1 - r0
            for c0 in range(0, n_in, TILE_COLS):
                c1 = min(n_in, c0 + TILE_COLS)
                cols, ncb = c1 - c0, _ceil_div(c1 - c0, BLOCK)
                # Pad partial edge tiles with zeros: they change no block maximum.
                buf = scratch("fp8_tile", (BLOCK, ncb * BLOCK), np.float32)
                if rows < BLOCK or cols < ncb * BLOCK:
                    buf[...] = 0.0
                load_f32(w[r0:r1, c0:c1], out=buf[:rows, :cols])
                mag = np.abs(buf, out=scratch("fp8_abs", buf.shape, np.float32))
                # Reduce over rows first: an element-wise max of contiguous rows vectorises,
                # a reduction along the 128-wide inner axis does not.
                amax = mag.reshape(BLOCK, ncb, BLOCK).max(axis=0).max(axis=1)
                if not np.isfinite(amax).all():
                    bad.append(rb)
                    return
                s = amax / np.float32(E4M3_MAX)
                s[amax == 0] = 1.0
                blocks = buf.reshape(BLOCK, ncb, BLOCK)
                np.divide(blocks, s[None, :, None], out=blocks)
                codes[r0:r1, c0:c1] = encode_e4m3(buf)[:rows, :cols]
                scales[rb, c0 // BLOCK: c0 // BLOCK + ncb] = s

        parallel_map(band, range(n_rb))
        if bad:
            check_finite_amax(np.array([np.nan]), what)
        return {"weight": codes.view(E4M3), "weight_scale_inv": scales}

    def dequantize(self, parts: Mapping[str, np.ndarray]) -> np.ndarray:
        q, s = np.asarray(parts["weight"]), np.asarray(parts["weight_scale_inv"], np.float32)
        if q.ndim != 2 or s.shape != (_ceil_div(q.shape[0], BLOCK), _ceil_div(q.shape[1], BLOCK)):
            raise QuantizationError(f"fp8_block: weight {q.shape} and weight_scale_inv {s.shape} "
                                    "do not match")
        full = np.repeat(np.repeat(s, BLOCK, axis=0), BLOCK, axis=1)[: q.shape[0], : q.shape[1]]
        return decode_e4m3(q) * full

    def tensor_specs(self, shape: tuple[int, int]) -> dict[str, TensorSpec]:
        n_out, n_in = shape
        return {"weight": (E4M3, (n_out, n_in)),
                "weight_scale_inv": (np.dtype(np.float32),
                                     (_ceil_div(n_out, BLOCK), _ceil_div(n_in, BLOCK)))}

    def quantization_config(self, ignore: list[str], *, kv_cache_fp8: bool = False) -> dict:
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": list(ignore),
                "ignored_layers": list(ignore)}

    @classmethod
    def matches(cls, quantization_config: Mapping | None) -> bool:
        return bool(quantization_config) and quantization_config.get("quant_method") == "fp8" \
            and list(quantization_config.get("weight_block_size") or []) == [BLOCK, BLOCK]
