"""Tiling shared by the two FP4 codecs (NVFP4, MXFP4): both scale groups of ``g`` consecutive
input elements of a row and pack two e2m1 codes per byte, element ``2j`` in the low nibble.

``quantize_groups`` walks the weight in row x column tiles (whole groups, L2-sized), hands each
tile as float32 ``[rows, n_groups, g]`` (a partial last group is zero-padded, which changes no
group maximum) to ``scale_fn``, which returns the per-group divisor (float32, ``inf`` where the
group must encode as zeros) and the scale codes to store; the e2m1 codes are then
``rne(x / divisor)``, saturating at +-6.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from convert.formats.numerics import (
    BF16,
    QuantizationError,
    encode_e2m1,
    load_f32,
    pack_nibbles,
    parallel_map,
    scratch,
)

TILE_ROWS = 32
TILE_COLS = 2048  # a multiple of both group sizes; 32 x 2048 float32 is 256 KiB

ScaleFn = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def check_even(shape: tuple[int, int], fmt: str, what: str) -> None:
    if shape[1] % 2:
        raise QuantizationError(f"{what}: {fmt} packs two values per byte along the input "
                                f"dimension, which must be even (shape {shape})")


def quantize_groups(w: np.ndarray, group: int, scale_dtype: np.dtype,
                    scale_fn: ScaleFn) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(packed uint8 [out, in/2], scale codes [out, ceil(in/group)])``."""
    n_out, n_in = w.shape
    n_groups = ceil_div(n_in, group)
    packed = np.empty((n_out, n_in // 2), np.uint8)
    scales = np.empty((n_out, n_groups), scale_dtype)
    tiles = [(r0, c0) for r0 in range(0, n_out, TILE_ROWS) for c0 in range(0, n_in, TILE_COLS)]

    def tile(rc: tuple[int, int]) -> None:
        r0, c0 = rc
        r1, c1 = min(n_out, r0 + TILE_ROWS), min(n_in, c0 + TILE_COLS)
        rows, cols = r1 - r0, c1 - c0
        ng = ceil_div(cols, group)
        buf = scratch(f"fp4_tile{group}", (rows, ng * group), np.float32)
        if cols < ng * group:
            buf[:, cols:] = 0.0
        load_f32(w[r0:r1, c0:c1], out=buf[:, :cols])
        grouped = buf.reshape(rows, ng, group)
        divisor, scale_codes = scale_fn(grouped)
        np.divide(grouped, divisor[:, :, None], out=grouped)
        packed[r0:r1, c0 // 2: c1 // 2] = pack_nibbles(encode_e2m1(buf))[:, : cols // 2]
        scales[r0:r1, c0 // group: c0 // group + ng] = scale_codes

    parallel_map(tile, tiles)
    return packed, scales


def group_amax(grouped: np.ndarray) -> np.ndarray:
    """Max |x| per group of a ``[rows, n_groups, g]`` tile (NaN/Inf propagate).

    numpy reduces a 16- or 32-wide inner axis an element at a time; transposing the groups to
    ``[g, rows * n_groups]`` first makes the reduction an element-wise max of contiguous rows,
    about 10x faster including the copy.
    """
    rows, ng, g = grouped.shape
    mag = np.abs(grouped.reshape(-1, g), out=scratch("fp4_abs", (rows * ng, g), np.float32))
    cols = scratch("fp4_absT", (g, rows * ng), np.float32)
    np.copyto(cols, mag.T)
    return cols.max(axis=0).reshape(rows, ng)


_MAGNITUDE_BITS = {BF16: (np.uint16, 0x7FFF), np.dtype(np.float32): (np.uint32, 0x7FFFFFFF)}


def tensor_amax(w: np.ndarray) -> float:
    """Max |x| over a whole 2-D tensor, in parallel row bands (NaN/Inf propagate).

    For bf16/f32 the max is taken over the magnitude bits as integers (sign masked off): for
    IEEE floats that order equals the order of |x|, and Inf/NaN patterns sort above every
    finite value, so one integer pass replaces convert + max + min.
    """
    n_out = w.shape[0]
    band = max(1, (1 << 18) // max(1, w.shape[1]))
    if w.dtype in _MAGNITUDE_BITS:
        itype, mask = _MAGNITUDE_BITS[w.dtype]
        bits = w.view(itype)

        def part_bits(r0: int) -> int:
            rows = bits[r0:r0 + band]
            return int(np.bitwise_and(rows, mask, out=scratch("amax_bits", rows.shape, itype))
                       .max())

        top = max(parallel_map(part_bits, range(0, n_out, band)))
        return float(np.array(top, itype).view(w.dtype).astype(np.float32))

    def part(r0: int) -> float:
        x = load_f32(w[r0:r0 + band], out=scratch("amax_band", w[r0:r0 + band].shape, np.float32))
        return float(max(x.max(), -x.min()))

    # np.max, not max(): NaN must win the comparison.
    return float(np.max(parallel_map(part, range(0, n_out, band))))


def expand_groups(per_group: np.ndarray, group: int, n_in: int) -> np.ndarray:
    """``[out, n_groups]`` -> ``[out, n_in]`` by repeating each group's value."""
    return np.repeat(per_group, group, axis=1)[:, :n_in]
