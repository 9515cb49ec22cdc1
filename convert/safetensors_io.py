"""Read and write single safetensors files with numpy, for every dtype the weight formats use.

The `safetensors` package's numpy binding knows no bf16 or fp8 dtypes, and the quantized exports
need BF16, F8_E4M3, F8_E5M2 and F8_E8M0 alongside the integer types. The file format is small and
fixed (https://github.com/huggingface/safetensors#format): an 8-byte little-endian header length,
a JSON header mapping each name to ``{dtype, shape, data_offsets}`` (offsets relative to the end
of the header), then the raw little-endian bytes, contiguous and in offset order. We implement it
here over ``ml_dtypes`` and ``np.memmap`` so a reader touches one tensor at a time; the tests check
that files written here load with the official ``safetensors.torch`` and vice versa.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

# safetensors dtype tag <-> numpy dtype. Order matters for the reverse map only where two tags
# would share a dtype (none do).
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
_TAGS: dict[np.dtype, str] = {v: k for k, v in DTYPES.items()}

# A header larger than this is not a weight file we wrote or would accept (the reference
# implementation caps it at 100 MB too); refusing early keeps a corrupt length from allocating GBs.
MAX_HEADER_BYTES = 100 * 1024 * 1024
_HASH_CHUNK = 8 * 1024 * 1024


class SafetensorsError(ValueError):
    """A safetensors file is malformed, truncated, or asks for something it does not hold."""


def dtype_tag(dtype: np.dtype) -> str:
    """The safetensors tag for a numpy dtype, e.g. ``bfloat16 -> "BF16"``."""
    try:
        return _TAGS[np.dtype(dtype)]
    except KeyError:
        raise SafetensorsError(f"dtype {np.dtype(dtype)} has no safetensors tag") from None


class SafetensorsFile:
    """A lazily read safetensors file: the header is parsed up front, tensors on demand.

    Every offset in the header is checked against the file size when the file is opened, so a
    truncated or corrupt file fails here with its path in the message, not later with a segfault
    or a silently short array.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise SafetensorsError(f"{self.path}: too short to be a safetensors file")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                raise SafetensorsError(f"{self.path}: header length {header_len} is corrupt")
            try:
                header = json.loads(f.read(header_len))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise SafetensorsError(f"{self.path}: header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{self.path}: header is not a JSON object")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._data_start = 8 + header_len
        data_len = size - self._data_start
        self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            try:
                dtype = DTYPES[info["dtype"]]
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(o) for o in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise SafetensorsError(
                    f"{self.path}: tensor {name!r} has a malformed or unsupported header entry "
                    f"{info!r}"
                ) from None
            expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if not 0 <= begin <= end <= data_len or end - begin != expected:
                raise SafetensorsError(
                    f"{self.path}: tensor {name!r} offsets [{begin}, {end}) do not fit its "
                    f"shape {shape} {info['dtype']} in {data_len} data bytes (truncated file?)"
                )
            self._entries[name] = (dtype, shape, begin, end)

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def info(self, name: str) -> tuple[np.dtype, tuple[int, ...]]:
        dtype, shape, _, _ = self._entry(name)
        return dtype, shape

    def span(self, name: str) -> tuple[int, int]:
        """``[begin, end)`` of the tensor's data bytes in the file (absolute offsets)."""
        _, _, begin, end = self._entry(name)
        return self._data_start + begin, self._data_start + end

    def get(self, name: str) -> np.ndarray:
        """Read one tensor into memory (a private copy, safe to keep after the file changes)."""
        dtype, shape, begin, end = self._entry(name)
        if end == begin:
            return np.zeros(shape, dtype)
        mm = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self._data_start + begin,
                       shape=(end - begin,))
        return np.array(mm.view(dtype).reshape(shape))

    def _entry(self, name: str):
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None


def write_file(path: str | os.PathLike, tensors: Mapping[str, np.ndarray],
               metadata: Mapping[str, str] | None = None, *, hasher=None,
               tensor_hashes: dict[str, str] | None = None) -> int:
    """Write ``tensors`` to ``path`` as one safetensors file; returns the bytes written.

    Writes to ``path + ".tmp"`` and renames, so a reader never sees a partial file. A
    ``hasher`` (e.g. ``hashlib.sha256()``) is fed every byte of the file on a second thread
    while the writes run (both release the GIL), so hashing costs no extra pass.
    ``tensor_hashes`` (a dict) is filled with the sha256 of each tensor's data bytes
    (``tensor_sha256``'s digest) on a third thread, for manifests that list them.
    """
    path = Path(path)
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    arrays = []
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        nbytes = arr.size * arr.dtype.itemsize
        header[name] = {"dtype": dtype_tag(arr.dtype), "shape": list(arr.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned, as the reference writer does
    chunks = [struct.pack("<Q", len(blob)), blob]
    for arr in arrays:
        arr = np.ascontiguousarray(arr)
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        # Write the array's own buffer: .tobytes() would copy every tensor once more.
        chunks.append(memoryview(arr.reshape(-1).view(np.uint8)))
    threads = []
    if hasher is not None:
        threads.append(threading.Thread(target=lambda: [hasher.update(c) for c in chunks],
                                        name="safetensors-hash"))
    if tensor_hashes is not None:
        names = list(tensors)

        def per_tensor() -> None:
            for name, chunk in zip(names, chunks[2:], strict=True):
                tensor_hashes[name] = hashlib.sha256(chunk).hexdigest()

        threads.append(threading.Thread(target=per_tensor, name="safetensors-tensor-hash"))
    for t in threads:
        t.start()
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
    finally:
        for t in threads:
            t.join()
    os.replace(tmp, path)
    return 8 + len(blob) + offset


def tensor_sha256(path: str | os.PathLike) -> dict[str, str]:
    """``{tensor name: sha256 of its data bytes}`` of one safetensors file (the per-tensor
    digests a version-2 manifest lists), read a bounded piece at a time."""
    f = SafetensorsFile(path)
    out = {}
    with open(f.path, "rb", buffering=0) as fh:
        buf = bytearray(_HASH_CHUNK)
        view = memoryview(buf)
        for name in f.keys():
            begin, end = f.span(name)
            h = hashlib.sha256()
            pos = begin
            while pos < end:
                n = os.preadv(fh.fileno(), [view[:min(_HASH_CHUNK, end - pos)]], pos)
                if n <= 0:
                    raise SafetensorsError(f"{f.path}: truncated inside {name!r}")
                h.update(view[:n])
                pos += n
            out[name] = h.hexdigest()
    return out


def iter_tensors(path: str | os.PathLike) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(name, array)`` for each tensor of one file, one in memory at a time."""
    f = SafetensorsFile(path)
    for name in f.keys():
        yield name, f.get(name)
