"""Weight-format behaviour the formats' mutants showed untested (issue 37; docs/testing.md)."""

from __future__ import annotations

import numpy as np

from convert.formats import FORMATS
from convert.formats import numerics as nx


def test_the_portable_nibble_packing_agrees_with_the_little_endian_one(monkeypatch):
    # pack_nibbles reads byte pairs as uint16 on little-endian hosts; the strided path is for the
    # others. Forced here, it must pack the same bytes (element 2j low, 2j+1 high).
    codes = np.random.default_rng(0).integers(0, 16, (3, 64), dtype=np.uint8)
    fast = nx.pack_nibbles(codes)
    monkeypatch.setattr(np, "little_endian", False)
    portable = nx.pack_nibbles(codes)
    assert portable.dtype == np.uint8 and np.array_equal(portable, fast)
    assert portable[0, 0] == codes[0, 0] | (codes[0, 1] << 4)
    np.testing.assert_array_equal(nx.unpack_nibbles(portable), codes)


def test_serving_rules_name_the_multiples_each_format_needs():
    fp8, int8, nvfp4 = FORMATS["fp8_block"], FORMATS["w8a8_int8"], FORMATS["nvfp4"]
    assert fp8.serving_rule((256, 384)) is None and int8.serving_rule((8, 16)) is None
    assert fp8.serving_rule((200, 256)).startswith("fp8_block needs both dimensions multiples of 128 (")
    assert int8.serving_rule((12, 16)).startswith("w8a8_int8 needs out a multiple of 8 and in of 16 (")
    assert nvfp4.serving_rule((7, 24)).startswith("nvfp4 needs the input dimension a multiple of 16 (")
