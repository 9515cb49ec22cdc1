"""The staged writes of an in-place reload: the served elements a new version changes, kept
until the engine's pause writes them (``sampler_torch.engine.reload``).

An entry belongs to one served tensor and holds either the flat positions of its changed
elements and their new bits (sparse: a few % of a bf16 tensor after an RL step, fewer quantized
codes) or a range from ``start`` with all its new bits (dense, when more than a third of a
compared piece changed: the positions would cost more than the values). Values are kept as
the integers of their element size (``fingerprint.as_int``): writes are byte-exact and need no
float8 indexing kernels. Entries stay on the engine's device up to ``budget`` bytes; past it they
go to an unlinked temp file, so even a version that changes every element (a new model) never
holds a second copy in memory.

A fused copy of a weight (``EngineForward.copies``: the matmul-dtype concatenations) is written
from the same entry, cast as ``EngineForward`` cast it, so a changed element is read once.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import torch

from sampler_torch.engine.fingerprint import as_int, sum_change, wrap64

#: dense entries beyond this share of changed elements (indices would outweigh the values)
DENSE_SHARE = 1 / 3

Copies = list[tuple[torch.Tensor, int]]
_SUM_PIECE = 1 << 18  # elements per fingerprint update (bounds its int64 temporaries)
_BLOCK = 16 << 20      # bytes per block of kept entries


@dataclasses.dataclass
class _Entry:
    target: torch.Tensor
    start: int
    count: int
    copies: Copies
    idx: torch.Tensor | None = None          # int64 flat positions (sparse entries)
    bits: torch.Tensor | None = None         # new values, ``as_int`` of the target's dtype
    dense: bool = False
    #: (offset in the spill file, index bytes, value bytes) once spilled, and the dtypes to read
    spilled: tuple[int, int, int] | None = None
    idx_dtype: torch.dtype | None = None
    bits_dtype: torch.dtype | None = None


class Stage:
    """Changes staged against the served tensors; ``sums`` follows each keyed tensor's
    ``tensor_sum`` as entries are added (the fingerprint after ``apply``)."""

    #: count ``lines`` while staging (benchmarks/bench_reload.py's bound). Off by default: it is a
    #: pass over every entry's positions per written tensor (~0.4 s of CPU for a 281 M bf16 delta
    #: whose staging takes ~0.55 s), a figure no reload needs.
    count_lines = False

    def __init__(self, budget: int, sums: dict[str, int], spill_dir: str | None = None):
        self.budget = budget
        self.sums = dict(sums)
        self.entries: list[_Entry] = []
        self.memory = 0        # bytes held for entries (whole blocks)
        self.spilled = 0       # bytes of entries in the spill file
        self.elements = 0      # served elements written (fused copies not counted)
        self.written = 0       # bytes written into served tensors, fused copies included
        #: (tensor, offset) -> bytes of every served tensor (or its part of a fused copy) with
        #: a change: what a reload writing whole changed tensors would copy
        self.touched: dict[tuple[int, int], int] = {}
        #: bytes of the 64-byte memory lines holding a written element, fused copies included
        #: (only with ``count_lines``): memory moves whole lines, so no write of these elements
        #: moves fewer (a line shared by two entries of one tensor counts twice: at most 64 bytes
        #: per entry over)
        self.lines = 0
        self._spill_dir = spill_dir
        self._file = None
        self._block: torch.Tensor | None = None  # the block kept entries are copied into
        self._used = 0

    # ------------------------------------------------------------------ staging

    def diff(self, key: str | None, target: torch.Tensor, start: int, new: torch.Tensor,
             copies: Copies = ()) -> int:
        """Stage the elements of ``new`` (flat, ``target``'s dtype and device) that differ bit
        for bit from ``target``'s flat elements from ``start``; return how many."""
        n = new.numel()
        old = as_int(target.view(-1)[start:start + n])
        nw = as_int(new.reshape(-1))
        changed = old != nw
        count = int(changed.sum())
        if not count:
            return 0
        if count > DENSE_SHARE * n:
            self._track(key, None, old, nw, start)  # unchanged elements add 0
            self._add(_Entry(target, start, n, list(copies), bits=nw, dense=True))
        else:
            idx = torch.nonzero(changed).view(-1)
            self.add(key, target, start, idx, old[idx], nw[idx], copies)
        return count

    def add(self, key: str | None, target: torch.Tensor, start: int, idx: torch.Tensor,
            old: torch.Tensor, new: torch.Tensor, copies: Copies = ()) -> None:
        """Stage ``target``'s flat elements ``start + idx`` (ascending) going from ``old`` to
        ``new`` (``as_int`` values; copied into the stage, the caller may reuse them)."""
        pos = (idx + start if start else idx).to(torch.int64)
        self._track(key, pos, old, new)
        lo, hi = int(pos[0]), int(pos[-1]) + 1
        if pos.numel() > DENSE_SHARE * (hi - lo):  # the run with its unchanged elements is smaller
            bits = as_int(target.view(-1)[lo:hi]).clone()
            bits[pos - lo] = new  # a temporary: _add keeps a copy
            self._add(_Entry(target, lo, hi - lo, list(copies), bits=bits, dense=True))
            return
        # int64 positions: int32 ones would halve their memory but cost a conversion per
        # entry in the pause (measured 2-40x the scatter itself on the 2-core development VM)
        self._add(_Entry(target, 0, int(idx.numel()), list(copies), idx=pos, bits=new))

    def _track(self, key: str | None, pos: torch.Tensor | None, old: torch.Tensor,
               new: torch.Tensor, start: int = 0) -> None:
        """Move ``sums[key]`` by elements ``pos`` (None: ``start, start + 1, ...``) going from
        ``old`` to ``new``, a bounded piece at a time (the int64 temporaries)."""
        if key is None:
            return
        total = self.sums[key]
        for a in range(0, old.numel(), _SUM_PIECE):
            b = min(old.numel(), a + _SUM_PIECE)
            p = (torch.arange(start + a, start + b, device=old.device) if pos is None
                 else pos[a:b])
            total += sum_change(p, old[a:b], new[a:b])
        self.sums[key] = wrap64(total)

    def _add(self, e: _Entry) -> None:
        self.touched[(id(e.target), 0)] = e.target.nbytes
        for c, offset in e.copies:
            self.touched[(id(c), offset)] = e.target.numel() * c.element_size()
        self.elements += e.count
        self.written += e.count * (e.target.element_size()
                                   + sum(c.element_size() for c, _ in e.copies))
        if self.count_lines:
            self._count_lines(e)
        size = e.bits.nbytes + (e.idx.nbytes if e.idx is not None else 0)
        if self.memory + size > self.budget:
            self._spill(e)
        else:
            e.bits = self._keep(e.bits)
            e.idx = None if e.idx is None else self._keep(e.idx)
        self.entries.append(e)

    def _count_lines(self, e: _Entry) -> None:
        """Add the bytes of the memory lines ``e`` writes (``lines``), in the served tensor
        and each fused copy."""
        known: dict[tuple[int, int], int] = {}  # (element size, address mod 64) -> lines
        for t, offset in [(e.target, 0), *e.copies]:
            size = t.element_size()
            base = t.data_ptr() + offset * size
            key = (size, base % 64)
            if key not in known:
                if e.idx is None:
                    lo, hi = base + e.start * size, base + (e.start + e.count) * size
                    known[key] = (hi - 1) // 64 - lo // 64 + 1
                else:
                    line = (e.idx * size + base % 64) // 64  # ascending
                    known[key] = 1 + int((line[1:] != line[:-1]).sum())
            self.lines += 64 * known[key]

    def _keep(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` in the stage's blocks. One allocation per block, not per entry: many
        small kept pieces among the comparisons' temporaries fragment the heap, whose freed
        holes then stay resident (measured: +32 % of a 280 M model's RSS on a full reload,
        against +8 % with the blocks)."""
        n = t.nbytes
        if n > _BLOCK // 2:
            self.memory += n
            return t.clone()
        if self._block is None or self._used + n > _BLOCK:
            self._block = torch.empty(_BLOCK, dtype=torch.uint8, device=t.device)
            self._used = 0
            self.memory += _BLOCK
        view = self._block[self._used:self._used + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        self._used += -(-n // 8) * 8  # every view starts 8-byte aligned (int64 positions)
        return view

    def _spill(self, e: _Entry) -> None:
        if self._file is None:
            self._file = tempfile.TemporaryFile(prefix="mixrl-reload-", dir=self._spill_dir)
        f = self._file
        offset = f.seek(0, os.SEEK_END)
        idx = e.idx.cpu().numpy().tobytes() if e.idx is not None else b""
        f.write(idx)
        f.write(e.bits.cpu().numpy().tobytes())
        e.spilled = (offset, len(idx), e.bits.nbytes)
        self.spilled += len(idx) + e.bits.nbytes
        e.idx_dtype = e.idx.dtype if e.idx is not None else None
        e.bits_dtype = e.bits.dtype
        e.idx = e.bits = None  # the memory goes back now

    def _load(self, e: _Entry, buf: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``e``'s positions and values; a spilled entry's read into ``buf`` (valid until the
        next entry is read)."""
        if e.spilled is None:
            return e.idx, e.bits
        offset, n_idx, n_bits = e.spilled
        raw = buf[:n_idx + n_bits]
        got = os.preadv(self._file.fileno(), [raw.numpy()], offset)
        if got != raw.numel():
            raise OSError(f"reload spill file: read {got} of {raw.numel()} bytes")
        dev = e.target.device
        idx = raw[:n_idx].view(e.idx_dtype).to(dev) if n_idx else None
        bits = raw[n_idx:].view(e.bits_dtype).to(dev)
        return idx, bits

    # ------------------------------------------------------------------ applying

    @torch.no_grad()
    def apply(self) -> None:
        """Write every staged change into its served tensor and the tensor's fused copies."""
        buf = None
        if self._file is not None:
            self._file.flush()  # spilled entries are read back by descriptor
            # one buffer for every spilled entry, not one per entry: no allocation, zeroing and
            # page faults per entry in the pause, and the writes read the bytes just read, still
            # in cache (measured: see the commit)
            most = max(e.spilled[1] + e.spilled[2] for e in self.entries if e.spilled is not None)
            buf = torch.empty(most, dtype=torch.uint8)
        for e in self.entries:
            idx, bits = self._load(e, buf)
            flat = as_int(e.target.view(-1))
            if e.dense:
                flat[e.start:e.start + e.count] = bits
            else:
                flat.index_copy_(0, idx, bits)
            for copy, offset in e.copies:
                vals = as_int(bits.view(e.target.dtype).to(copy.dtype))
                cflat = as_int(copy.view(-1))
                if e.dense:
                    cflat[offset + e.start:offset + e.start + e.count] = vals
                else:
                    cflat[offset:offset + e.target.numel()].index_copy_(0, idx, vals)
        self.close()

    def close(self) -> None:
        """Drop what is staged (after ``apply``, or when the reload is abandoned)."""
        self.entries = []
        self._block = None
        if self._file is not None:
            self._file.close()
            self._file = None


__all__ = ["DENSE_SHARE", "Stage"]
