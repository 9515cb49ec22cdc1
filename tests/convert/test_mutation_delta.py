"""Delta-codec behaviour the delta modules' mutants showed untested (issue 37; docs/testing.md)."""

from __future__ import annotations

import json
import struct

from convert.delta_codec import layout


def _safetensors(path, header: dict, data: bytes, pad_to: int) -> None:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % pad_to)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_layout_keeps_each_tensors_itemsize_whatever_the_header_alignment(tmp_path):
    # safetensors pads its header to 8 bytes, but nothing requires it: with an odd header the
    # tensors start at odd offsets and are still whole elements (bf16: 2, f32: 4), so the codec
    # XORs them as such; only a span that is not a whole number of elements falls back to bytes.
    header = {"__metadata__": {"format": "pt"},
              "a": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [6, 14]},
              "c": {"dtype": "F32", "shape": [1], "data_offsets": [14, 20]}}  # 6 bytes: not whole
    for pad in (1, 8):
        path = tmp_path / f"model-{pad}.safetensors"
        _safetensors(path, header, bytes(range(20)), pad)
        head, regions = layout(path)
        start = len(head)
        assert (start % 8 == 0) == (pad == 8) and (pad == 8 or start % 2 == 1), start
        assert regions == [(start, start + 6, 2), (start + 6, start + 14, 4), (start + 14, start + 20, 1)]
