"""Delta-codec behaviour the delta modules' mutants showed untested (issue 37; docs/testing.md)."""

from __future__ import annotations

import hashlib
import json
import struct

from convert.delta_codec import HashingWriter, layout


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


def test_hashing_writer_reuses_a_buffer_only_after_its_write_and_hash(tmp_path):
    # 64 pieces through the writer's 3 buffers: filling one is a copy, hashing it (sha256, on its
    # own thread) costs ~20x more, so a buffer lent again before its hash is done would be
    # overwritten under it: the file or the digest would not be what was committed.
    pieces = [bytes([i]) * (1 << 20) for i in range(64)]
    with HashingWriter(tmp_path / "out.bin") as w:
        for p in pieces:
            w.buffer(len(p))[:] = p
            w.commit()
        size, digest = w.close()
    whole = b"".join(pieces)
    assert (size, digest) == (len(whole), hashlib.sha256(whole).hexdigest())
    assert (tmp_path / "out.bin").read_bytes() == whole
