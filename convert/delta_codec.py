"""The element-level codec of delta versions (``convert.delta``) and the one-pass apply of a chain.

A changed safetensors file whose layout (header, size) equals its base's is stored, per piece of
whole elements (at most ``piece_bytes`` of the file at a time, in file order; the header and any
padding count as 1-byte elements), as::

    uint32 nnz | uint8 w | nnz gaps of w bytes, in byte planes | nnz values XOR base, in k byte planes

``gaps`` are the differences between the indices of successive changed elements (the first one
is its index), ``w`` the fewest bytes (1, 2 or 4) that hold the piece's largest. Decoding walks
only the changed elements (a cumulative sum, then one gather and one scatter), a few % of bf16
elements and far fewer quantized codes; the bitmask of delta format 1 made every element cost
(unpacking it and a boolean scatter were most of a sampler's apply time). Byte planes (byte 0
of every value, then byte 1, ...) keep the mostly-zero high bytes of gaps and of small XORs
together for zstd, and are put back together with shifts (a strided transpose cost 10x more).
The stream is zstd with its checksum.

Applying writes every output file once, whatever the length of the chain: each piece of the base
is read into a buffer, each delta's changes are XORed into it in place, and the buffer is handed
to a thread that writes it and one that hashes it (``HashingWriter``): the serial sha256 and the
writes are most of the work and release the GIL, so they overlap reading and decoding the next
piece, and the digest of what was written comes without reading the file again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import shutil
import struct
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from convert.manifest import sha256_file
from convert.safetensors_io import DTYPES, MAX_HEADER_BYTES

PIECE_BYTES = 16 * 1024 * 1024  # bytes of a file handled at a time (bounded memory)
MAX_PIECE_BYTES = 1 << 31  # indices and counts of a piece are uint32
_GAP_WIDTHS = (1, 2, 4)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14; older: EINVAL
Digest = tuple[int, str]  # (size, sha256 hex) of a written file


class DeltaError(RuntimeError):
    """A delta cannot be applied: a gap in the chain, a corrupt or truncated blob, a bad base."""


# --------------------------------------------------------------------------- safetensors layout


def layout(path: Path) -> tuple[bytes, list[tuple[int, int, int]]] | None:
    """``(header bytes, [(begin, end, itemsize)])`` covering the data of a safetensors file in
    file order (absolute offsets, contiguous up to the end of the file); ``None`` if the file is
    not one."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                return None
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                return None
            head = f.read(n)
        header = json.loads(head)
        start = 8 + n
        spans = sorted((int(e["data_offsets"][0]), int(e["data_offsets"][1]),
                        DTYPES[e["dtype"]].itemsize)
                       for k, e in header.items() if k != "__metadata__")
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
    regions, pos = [], start
    for begin, end, k in spans:
        begin, end = begin + start, end + start
        if begin < pos or end > size:
            return None  # overlapping or out of range: not a layout we can split safely
        if begin > pos:
            regions.append((pos, begin, 1))
        if (end - begin) % k:
            k = 1
        regions.append((begin, end, k))
        pos = end
    if pos < size:
        regions.append((pos, size, 1))
    return raw + head, regions


def pieces(regions: list[tuple[int, int, int]], piece_bytes: int) -> Iterator[tuple[int, int, int]]:
    """``(offset, nbytes, itemsize)`` pieces of at most ~``piece_bytes`` bytes, whole elements each."""
    for begin, end, k in regions:
        step = max(k, piece_bytes - piece_bytes % k)
        for off in range(begin, end, step):
            yield off, min(step, end - off), k


# --------------------------------------------------------------------------- pieces


def _element(k: int) -> np.dtype:
    """The unsigned type elements of ``k`` bytes are compared and XORed as (bytes if unusual);
    little-endian, as the files are, so byte plane j is bits 8j.. of the value on any host."""
    return np.dtype(f"<u{k}" if k in (1, 2, 4, 8) else np.uint8)


def _planes(a: np.ndarray) -> bytes:
    """``a``'s bytes as byte planes: byte 0 of every element, then byte 1, ..."""
    b = a.view(np.uint8)
    return b.tobytes() if a.itemsize == 1 else np.ascontiguousarray(b.reshape(-1, a.itemsize).T).tobytes()


def _unplanes(raw: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The little-endian-valued elements of ``dtype`` whose byte planes are ``raw`` (the
    inverse of ``_planes`` on a little-endian host)."""
    k = dtype.itemsize
    planes = raw.reshape(k, -1)
    out = planes[k - 1].astype(dtype)
    for j in range(k - 2, -1, -1):
        out <<= 8
        out |= planes[j]
    return out


def encode_piece(new: np.ndarray, base: np.ndarray, k: int, digest: ChangeDigest | None = None,
                 first: int = 0) -> bytes:
    """The encoded changes taking the bytes ``base`` to ``new`` (one piece of ``k``-byte elements);
    ``digest`` (of the tensor the piece lies in, whose element ``first`` it starts at) is fed
    the changes."""
    dt = _element(k)
    n, b = new.view(dt), base.view(dt)
    idx = np.flatnonzero(n != b)
    if digest is not None:
        digest.update(idx + first, n[idx])
    gaps = np.diff(idx, prepend=0)
    top = int(gaps.max()) if gaps.size else 0
    w = next(w for w in _GAP_WIDTHS if top < 1 << (8 * w))
    return (struct.pack("<IB", idx.size, w) + _planes(gaps.astype(f"<u{w}"))
            + _planes(n[idx] ^ b[idx]))


def read_piece(stream, nbytes: int, k: int, what: str) -> tuple[np.ndarray, np.ndarray] | None:
    """One piece's changes from ``stream`` (a piece of ``nbytes`` bytes of ``k``-byte elements):
    the indices of the changed elements (ascending, int32 in any piece up to 2**31 elements) and
    their XOR against the base (as ``_element(k)`` values); ``None`` when none changed."""
    dt = _element(k)
    nel = nbytes // dt.itemsize
    nnz, w = struct.unpack("<IB", read_exact(stream, 5, what))
    if nnz > nel or w not in _GAP_WIDTHS:
        raise DeltaError(f"{what}: corrupt ({nnz} changes of gap width {w} in a piece of {nel} elements)")
    if not nnz:
        return None
    raw = np.frombuffer(read_exact(stream, nnz * (w + dt.itemsize), what), np.uint8)
    gaps = _unplanes(raw[:nnz * w], np.dtype(f"<u{w}"))
    last = int(gaps.sum(dtype=np.int64))
    if last >= nel:
        raise DeltaError(f"{what}: corrupt (element {last} of a piece of {nel})")
    # int32 indices (a piece holds fewer than 2**31 elements: MAX_PIECE_BYTES), half the memory
    # of int64 ones; the checked sum above rules out a wrap
    idx = gaps.astype(np.int32 if nel <= 2 ** 31 else np.int64)
    np.cumsum(idx, out=idx)  # in place: a casting cumsum costs twice as much
    return idx, _unplanes(raw[nnz * w:], dt)


def xor_piece(stream, buf: np.ndarray, k: int, what: str) -> None:
    """Apply one piece's changes read from ``stream`` to the bytes ``buf``, in place."""
    changes = read_piece(stream, buf.size, k, what)
    if changes is not None:
        buf.view(_element(k))[changes[0]] ^= changes[1]


class ChangeDigest:
    """The sha256 of one tensor's changes in a delta (``delta_version`` 3): over the changed
    elements in ascending order, each as its index in the tensor (uint64, little-endian)
    followed by its new bytes as stored. Fed piece by piece, in order; the same digest whatever
    the pieces. It proves the changed elements and their new values without the rest of the
    tensor: with the base's bytes proven (the version served), base + these changes is the
    trainer's new tensor."""

    def __init__(self):
        self._h = hashlib.sha256()
        self.count = 0

    def update(self, idx: np.ndarray, new: np.ndarray) -> None:
        """``idx``: element indices in the tensor (ascending, after those of earlier calls);
        ``new``: their new values (any dtype of the element's size)."""
        n = int(idx.size)
        if not n:
            return
        k = new.dtype.itemsize
        rec = np.empty((n, 8 + k), np.uint8)
        rec[:, :8] = np.ascontiguousarray(idx, "<u8").view(np.uint8).reshape(n, 8)
        rec[:, 8:] = np.ascontiguousarray(new).view(np.uint8).reshape(n, k)
        self._h.update(rec)
        self.count += n

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def region_names(header: bytes) -> dict[int, str]:
    """``{absolute offset of a tensor's data: name}`` for the safetensors ``header`` bytes that
    ``layout`` returns (length prefix included): which region of ``layout`` is which tensor."""
    start = len(header)
    entries = json.loads(header[8:])
    return {start + int(e["data_offsets"][0]): name for name, e in entries.items()
            if name != "__metadata__" and int(e["data_offsets"][1]) > int(e["data_offsets"][0])}


def read_exact(f, n: int, what: str, into: memoryview | None = None) -> memoryview:
    """``n`` bytes of ``f`` (into ``into`` if given); ``DeltaError`` naming ``what`` if they are
    not all there or ``f`` cannot be read (a zstd stream raises on corrupt data)."""
    view = memoryview(bytearray(n)) if into is None else into[:n]
    got = 0
    while got < n:
        try:
            k = f.readinto(view[got:])
        except Exception as e:  # noqa: BLE001 - zstd's errors share no base with OSError
            raise DeltaError(f"{what}: corrupt or truncated ({e})") from None
        if not k:
            raise DeltaError(f"{what}: truncated ({got} of {n} bytes)")
        got += k
    return view


# --------------------------------------------------------------------------- writing


class HashingWriter:
    """A file written in order, piece by piece, and hashed, each on a thread of its own.

    ``buffer(n)`` lends a buffer to fill, ``commit()`` queues it for writing and for hashing;
    a buffer is reused once both are done. Writing (page-cache allocation: the costliest step
    on a VM) and the serial sha256 overlap each other and the reading and decoding of the next
    pieces (file writes and hashlib release the GIL). ``close()`` returns ``(size, sha256)`` of
    exactly what was written.
    """

    _SLOTS = 3  # one being filled, one being written and hashed, one spare so no side waits

    def __init__(self, path: Path):
        self._f = open(path, "wb", buffering=0)
        self._h = hashlib.sha256()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="mixrl-delta-write")
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="mixrl-delta-hash")
        self._bufs: list[bytearray] = [bytearray() for _ in range(self._SLOTS)]
        self._busy: list[tuple[Future, ...]] = [() for _ in range(self._SLOTS)]
        self._slot, self._size = 0, 0
        self._view: memoryview | None = None

    def __enter__(self) -> HashingWriter:
        return self

    def __exit__(self, *exc) -> None:
        self._writer.shutdown(wait=True)
        self._hasher.shutdown(wait=True)
        self._f.close()

    def buffer(self, n: int) -> memoryview:
        s = self._slot
        for f in self._busy[s]:
            f.result()
        self._busy[s] = ()
        if len(self._bufs[s]) < n:
            self._bufs[s] = bytearray(n)  # a new object: the old one may still be exported
        self._view = memoryview(self._bufs[s])[:n]
        return self._view

    def commit(self, n: int | None = None) -> None:
        view = self._view if n is None else self._view[:n]
        self._busy[self._slot] = (self._writer.submit(self._write, view),
                                  self._hasher.submit(self._h.update, view))
        self._slot = (self._slot + 1) % self._SLOTS
        self._size += len(view)

    def _write(self, view: memoryview) -> None:
        done = 0
        while done < len(view):
            done += self._f.write(view[done:])

    def close(self) -> Digest:
        self._writer.shutdown(wait=True)
        self._hasher.shutdown(wait=True)
        for fs in self._busy:
            for f in fs:
                f.result()  # a failed write or hash raises here
        self._f.close()
        return self._size, self._h.hexdigest()


def sha256_of(path: Path) -> Digest:
    return path.stat().st_size, sha256_file(path)


# --------------------------------------------------------------------------- files


def decompress_file(zstd, blob: Path, dest: Path, piece_bytes: int) -> Digest:
    """Write the file stored whole (zstd) in ``blob`` to ``dest``."""
    with open(blob, "rb") as fz, zstd.ZstdDecompressor().stream_reader(fz) as r, \
            HashingWriter(dest) as w:
        while True:
            buf = w.buffer(piece_bytes)
            try:
                got = r.readinto(buf)
            except zstd.ZstdError as e:
                raise DeltaError(f"{blob}: corrupt or truncated ({e})") from None
            if not got:
                return w.close()
            w.commit(got)


def xor_file(zstd, base: Path, blobs: Sequence[Path], dest: Path, piece_bytes: int) -> Digest:
    """Write ``dest``: the safetensors file ``base`` with the XOR deltas ``blobs`` (oldest first,
    each made against the file the previous one produces, all of ``base``'s layout) applied.

    The base is copied by the kernel (``copy_file_range``/``sendfile``: no pass through our
    memory) and the changes are XORed into a shared mapping of the copy, piece by piece, each
    piece hashed from the mapping on a second thread while the next one is decoded. On the
    development VM (Firecracker, nested virtualization) ``write()`` of 563 MB from our buffers
    cost 1.7-6.9 CPU s where ``copy_file_range``/``sendfile`` cost 0.25 s in the same minute;
    the mapping only needs the pages the kernel copy already made.
    """
    lay = layout(base)
    if lay is None:
        raise DeltaError(f"base file {base} is not a safetensors file")
    header, regions = lay
    shutil.copyfile(base, dest)
    size = dest.stat().st_size
    h = hashlib.sha256()
    with ExitStack() as stack:
        readers = [(stack.enter_context(zstd.ZstdDecompressor().stream_reader(
            stack.enter_context(open(b, "rb")))), str(b)) for b in blobs]
        f = stack.enter_context(open(dest, "r+b"))
        m = mmap.mmap(f.fileno(), size)
        stack.callback(_close_mapping, m)
        with contextlib.suppress(AttributeError, OSError, ValueError):
            m.madvise(_MADV_POPULATE_WRITE)  # one call maps every page writable, not a fault each
        view = memoryview(m)
        stack.callback(_release, view)
        # entered last, so it exits first: no hash still reads the mapping when it is released
        hasher = stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="mixrl-delta-hash"))
        data = np.frombuffer(view, np.uint8)
        hashes: list[Future] = []
        done = 0  # bytes handed to the hasher (in file order: pieces are contiguous)
        for off, n, k in pieces(regions, piece_bytes):
            for r, what in readers:
                xor_piece(r, data[off:off + n], k, what)
            hashes.append(hasher.submit(h.update, view[done:off + n]))
            done = off + n
        hashes.append(hasher.submit(h.update, view[done:size]))
        for r, what in readers:
            if read_rest(r, what):
                raise DeltaError(f"{what}: longer than its base file")
        for fut in hashes:
            fut.result()
        del data, hashes
    return size, h.hexdigest()


def _release(view: memoryview) -> None:
    with contextlib.suppress(BufferError):  # an array still held by a traceback: freed with it
        view.release()


def _close_mapping(m: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # a view still held by a traceback: closed when freed
        m.close()


def read_rest(r, what: str) -> bool:
    """Whether the stream ``r`` has data left (reading to its end checks zstd's checksum)."""
    try:
        return bool(r.read(1))
    except Exception as e:  # noqa: BLE001 - zstd's errors share no base with OSError
        raise DeltaError(f"{what}: corrupt or truncated ({e})") from None
