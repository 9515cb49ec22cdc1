"""A delta's per-tensor change records against a reference computed here (issue 46, the human-style
mutants of ``delta``; docs/testing.md).

The records (``files[rel]["tensors"]``: how many elements of each tensor changed and the sha256 of
their indices in the tensor and new bytes) are what a sampler applying the delta in place checks
(``sampler_torch.engine.reload_delta``): an index counted from the file's start instead of the
tensor's, or every change filed under one name, makes a correct delta fail that check. Also
``read_exact`` into a caller's buffer, and ``HashingWriter`` lending the next buffer while the last
is still being written (its reason to exist).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading

import numpy as np
import pytest
from safetensors.numpy import save_file

from convert.delta import DELTA_NAME, encode_delta
from convert.delta_codec import DeltaError, HashingWriter, read_exact
from convert.manifest import write_manifest


def _reference(old: np.ndarray, new: np.ndarray) -> dict:
    """{"changed", "sha256"} of ``new`` against ``old`` (same dtype and shape), per the delta's
    documented rule: each changed element (its bytes differ) in ascending order, as its index in
    the tensor (uint64, little-endian) followed by its new bytes."""
    k = new.dtype.itemsize
    a = np.ascontiguousarray(old).reshape(-1).view(np.uint8).reshape(-1, k)
    b = np.ascontiguousarray(new).reshape(-1).view(np.uint8).reshape(-1, k)
    h = hashlib.sha256()
    idx = [i for i in range(len(b)) if bytes(a[i]) != bytes(b[i])]
    for i in idx:
        h.update(i.to_bytes(8, "little") + bytes(b[i]))
    return {"changed": len(idx), "sha256": h.hexdigest()}


def test_each_tensors_change_record_counts_its_own_indices_under_its_own_name(tmp_path):
    rng = np.random.default_rng(46)
    old = {"a.weight": rng.standard_normal((8, 16)).astype(np.float32),
           "b.bias": rng.standard_normal(40).astype(np.float32),
           "c.codes": rng.integers(-128, 128, (6, 10), dtype=np.int8),
           "d.same": rng.standard_normal(12).astype(np.float32)}  # unchanged: no record
    new = {k: v.copy() for k, v in old.items()}
    new["a.weight"][0, 0] += 1.0                    # the tensor's first element
    new["a.weight"][3, 5] -= 2.0
    new["a.weight"][7, 15] *= 3.0                   # and its last
    new["b.bias"][[0, 17, 39]] += 0.5
    new["c.codes"][2, 3] = np.int8(-new["c.codes"][2, 3] - 1)
    for name, tensors in (("base", old), ("new", new)):
        (tmp_path / name).mkdir()
        save_file(tensors, str(tmp_path / name / "model.safetensors"))
        write_manifest(tmp_path / name)
    encode_delta(tmp_path / "new", tmp_path / "base", tmp_path / "delta", version=1, base_version=0)
    entry = json.loads((tmp_path / "delta" / DELTA_NAME).read_text())["files"]["model.safetensors"]
    assert entry["op"] == "xor"
    assert entry["tensors"] == {name: _reference(old[name], new[name])
                                for name in ("a.weight", "b.bias", "c.codes")}
    assert entry["tensors"]["a.weight"]["changed"] == 3 and entry["tensors"]["c.codes"]["changed"] == 1


def test_read_exact_into_a_buffer_fills_its_first_n_bytes_from_a_stream_of_short_reads(tmp_path):
    # read_exact's `into` (no caller passes it today): the n bytes land in the buffer's first n,
    # the rest untouched, however few bytes each read returns; one byte short is a DeltaError.
    class Trickle(io.RawIOBase):
        def __init__(self, data: bytes):
            self.data, self.pos = data, 0

        def readable(self) -> bool:
            return True

        def readinto(self, b) -> int:
            n = min(3, len(b), len(self.data) - self.pos)
            b[:n] = self.data[self.pos:self.pos + n]
            self.pos += n
            return n

    data = bytes(range(1, 21))
    buf = memoryview(bytearray(b"\xff" * 32))
    got = read_exact(Trickle(data), 20, "piece", into=buf)
    assert bytes(got) == data and len(got) == 20
    assert bytes(buf) == data + b"\xff" * 12
    assert bytes(read_exact(Trickle(data), 20, "piece")) == data
    with pytest.raises(DeltaError, match="truncated"):
        read_exact(Trickle(data[:19]), 20, "piece", into=memoryview(bytearray(32)))



def _drain(fd: int) -> bytes:
    out = bytearray()
    while chunk := os.read(fd, 1 << 16):
        out += chunk
    return bytes(out)


def test_the_hashing_writer_lends_the_next_buffer_while_the_last_is_still_being_written(tmp_path):
    # HashingWriter's point: the write of one piece overlaps the filling of the next. Written to a
    # FIFO nobody reads yet, the first committed megabyte blocks the writer thread (a pipe holds
    # 64 KiB); the next buffer must still be lent at once (another slot), not after that write.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # so the writer's open does not block
    pieces = [bytes([i + 1]) * (1 << 20) for i in range(2)]
    received = bytearray()
    drain = threading.Thread(target=lambda: received.extend(_drain(reader)), daemon=True)
    lent = threading.Event()
    w = HashingWriter(fifo)

    def fill_next():
        w.buffer(len(pieces[1]))[:] = pieces[1]
        lent.set()

    filler = threading.Thread(target=fill_next, daemon=True)
    try:
        w.buffer(len(pieces[0]))[:] = pieces[0]
        w.commit()
        filler.start()
        in_time = lent.wait(10)
    finally:
        os.set_blocking(reader, True)
        drain.start()  # lets the blocked write finish either way
    filler.join(30)
    w.commit()
    size, digest = w.close()
    w.__exit__(None, None, None)
    drain.join(30)
    os.close(reader)
    assert in_time, "the next buffer was lent only after the last one's write"
    whole = b"".join(pieces)
    assert (size, digest) == (len(whole), hashlib.sha256(whole).hexdigest())
    assert bytes(received) == whole
