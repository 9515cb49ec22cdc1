"""A delta version applied straight into the served weights (``Engine.load_weights`` given a
delta directory, ``delta_version`` 3, whose base is the version served): never materialized.

The blobs are walked once, piece by piece (``convert.delta_codec.read_piece``: the indices of the
changed elements and their XOR). A tensor the model holds in the stored bits (a plain tensor in
its stored dtype, or a bf16 one held in float32, without the ``round_weights`` dial) is updated
element by element: the old stored bits are read back from the served tensor at the changed
indices only, XORed, and the new values staged (``sampler_torch.engine.stage``). A quantized
projection (its module is built from all its parts) and a rounded weight are rebuilt whole from
the served version's stored parts -- recovered from the module where it keeps them
(``QuantLinear.stored_parts``), else read from the directory the version was loaded from --
with the changes applied, one module at a time.

Why the result is the trainer's version although no file of it ever exists here, by induction
over the versions served:

- the version served, v, equals the trainer's v: a full load verified every tensor's sha256 (or
  every file's), and each step below keeps it;
- the delta names its base by the sha256 of v's ``manifest.json`` (``base_manifest_sha256``),
  which must be the served manifest's; v+1's manifest (with per-tensor digests) is embedded;
- for every tensor, the delta's change record (count and ``ChangeDigest`` of each changed
  element's index and *new* bytes, computed by the trainer from its v and v+1) must match the
  changes as applied here -- the new bytes are the served bytes XOR the delta's, so a served
  byte that differed from v's at a changed element fails too;
- the tensors with change records must be exactly those whose digest differs between v's and
  v+1's manifests, and every other tensor keeps its (proven) bytes.

So every element served after the step is the trainer's v+1 element. The fingerprint is moved by
the same changes, and the version probe still scores what is served.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from convert.delta import DELTA_NAME, parse_delta
from convert.delta_codec import ChangeDigest, DeltaError, pieces, read_piece, read_rest
from convert.manifest import tensor_digests
from sampler_torch.engine.fingerprint import as_int
from sampler_torch.engine.reload import (
    FileSource,
    MemorySource,
    ModuleUnit,
    PlainUnit,
    Plan,
    Served,
    TensorInfo,
    Units,
    kv_lists,
    stage_unit,
)
from sampler_torch.engine.stage import Stage
from sampler_torch.recipes import RecipeError, WeightLoadError
from sampler_torch.recipes.loader import kv_scale_names, kv_scale_value
from sampler_torch.tensors import to_torch

_BATCH = 1 << 20  # changed elements staged at a time


def plan_delta(served: Served, units: Units, delta_dir: str | os.PathLike, version: int, *,
               budget: int | None = None) -> Plan:
    """Stage the delta at ``delta_dir`` as ``version`` against ``served`` (see the module doc);
    ``WeightLoadError`` (nothing staged survives) when it is not built on the version served,
    does not verify, or changes what cannot change in place."""
    delta_dir = Path(delta_dir)
    try:
        import zstandard
    except ImportError:
        raise WeightLoadError("delta versions need the zstandard package: pip install zstandard") from None
    try:
        meta = parse_delta((delta_dir / DELTA_NAME).read_text(), str(delta_dir))
    except OSError as e:
        raise WeightLoadError(f"{delta_dir}: cannot read {DELTA_NAME} ({e.strerror})") from None
    except DeltaError as e:
        raise WeightLoadError(str(e)) from None
    new_manifest = _check_base(meta, served, units, delta_dir, int(version))
    new_digests = tensor_digests(new_manifest)
    stage = Stage(budget or units.budget(), served.sums)
    run = _Run(served, units, stage, delta_dir, meta)
    try:
        for rel, entry in sorted(meta["files"].items()):
            if entry["op"] == "same":
                if served.manifest["files"].get(rel, {}).get("sha256") != \
                        new_manifest["files"][rel]["sha256"]:
                    raise DeltaError(f"{delta_dir}: {rel} is marked unchanged, but the manifests differ")
            elif rel in served.regions or rel == "config.json" or rel.endswith(".index.json"):
                if entry["op"] != "xor" or rel not in served.regions:
                    raise DeltaError(f"{delta_dir}: {rel} is stored whole (its layout or the config "
                                     "changed); load the materialized directory")
                run.xor_file(rel, entry, zstandard)
            # other files (tokenizer, probe) hold no weights
        run.rebuild()
    except DeltaError as e:
        stage.close()
        raise WeightLoadError(f"{delta_dir}: v{version}: {e}") from None
    except BaseException:
        stage.close()
        raise
    changed = {n for n, (_, sha) in new_digests.items() if served.digests[n][1] != sha}
    recorded = {n for e in meta["files"].values() for n in e.get("tensors", {})}
    if not changed == recorded == run.done:
        stage.close()
        odd = sorted(changed ^ run.done | recorded ^ run.done)
        raise WeightLoadError(f"{delta_dir}: v{version}: the delta's changes and its manifest "
                              f"disagree on which tensors changed (e.g. {odd[:3]})")
    k, v = kv_lists(run.scales, units.lay.cfg.num_hidden_layers)
    text = meta["manifest"]
    new = Served(int(version), delta_dir, served.hf_config, new_manifest,
                 hashlib.sha256(text.encode()).hexdigest(), new_digests, served.tensors,
                 served.regions, None, stage.sums, k, v, units.digest(stage.sums, k, v))
    plan = Plan(stage, new, f"v{served.version} served + 1 delta ({len(changed)} tensors changed)",
                len(changed))
    return plan


def _check_base(meta: dict, served: Served, units: Units, where: Path, version: int) -> dict:
    """v+1's manifest, once the delta is shown to be built on exactly the version served."""
    if int(meta["delta_version"]) < 3:
        raise WeightLoadError(f"{where}: delta_version {meta['delta_version']} carries no change "
                              "digests to verify in place; materialize it (mixrl-convert materialize) "
                              "and load the directory")
    if int(meta["version"]) != version:
        raise WeightLoadError(f"{where}: holds version {meta['version']}, loaded as {version}")
    if served.digests is None or served.manifest_sha is None:
        raise WeightLoadError(f"{where}: the version served (v{served.version}) has no per-tensor "
                              "digests (a version-1 manifest or none): load a full directory")
    if int(meta["base"]) != served.version or meta.get("base_manifest_sha256") != served.manifest_sha:
        raise WeightLoadError(f"{where}: built on version {meta['base']}"
                              + (" of another publish" if int(meta["base"]) == served.version else "")
                              + f", the engine serves version {served.version}")
    manifest = json.loads(meta["manifest"])
    if manifest.get("format") != units.lay.codec.name:
        raise RecipeError(f"{where} holds {manifest.get('format')} weights; recipe "
                          f"{units.recipe.name!r} needs {units.lay.codec.name}")
    digests = tensor_digests(manifest)
    if digests is None or set(digests) != set(served.digests):
        raise WeightLoadError(f"{where}: v{version}'s manifest lists other tensors (or none by "
                              "digest) than the version served")
    return manifest


class _Run:
    """One delta's walk: element-wise updates staged as they are decoded, whole-tensor changes
    gathered for ``rebuild``."""

    def __init__(self, served: Served, units: Units, stage: Stage, where: Path, meta: dict):
        self.served, self.units, self.stage, self.where, self.meta = served, units, stage, where, meta
        self.changes: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        self.records: dict[str, dict] = {}
        self.done: set[str] = set()
        self.kv = {n: (i, j) for i in range(units.lay.cfg.num_hidden_layers)
                   for j, w in enumerate("kv") for n in kv_scale_names(i, w)}
        scales = (served.k_scales, served.v_scales)
        self.scales = {i: tuple(None if scales[j] is None or not self._has(i, j) else scales[j][i]
                                for j in range(2)) for i in range(units.lay.cfg.num_hidden_layers)}

    def _has(self, layer: int, j: int) -> bool:
        return any(n in self.served.tensors for n in kv_scale_names(layer, "kv"[j]))

    def xor_file(self, rel: str, entry: dict, zstd) -> None:
        """Walk one file's blob: stage or gather each tensor's changes, checking its record."""
        records = entry.get("tensors", {})
        self.records.update(records)
        names = {t.begin: n for n, t in self.served.tensors.items() if t.rel == rel}
        piece_bytes = int(self.meta["piece_bytes"])
        blob = self.where / entry["blob"]
        what = str(blob)
        with open(blob, "rb") as f, zstd.ZstdDecompressor().stream_reader(f) as r:
            for begin, end, k in self.served.regions[rel]:
                name = names.get(begin)
                unit = self.units.of.get(name)
                sparse = self._sparse_ok(unit, name)
                digest = ChangeDigest()
                for off, n, kk in pieces([(begin, end, k)], piece_bytes):
                    got = read_piece(r, n, kk, what)
                    if got is None:
                        continue
                    if name is None:
                        raise DeltaError(f"{what}: corrupt (changes outside any tensor of {rel})")
                    first = (off - begin) // kk  # the piece's first element in the tensor
                    idx = got[0] + first if first + n // kk < 2 ** 31 else got[0].astype(np.int64) + first
                    if not sparse:
                        self.changes.setdefault(name, []).append((idx, got[1]))
                        continue
                    for a in range(0, idx.size, _BATCH):  # bounded temporaries per batch
                        part = idx[a:a + _BATCH]
                        digest.update(part, self._apply_sparse(unit, self.served.tensors[name], part,
                                                               got[1][a:a + _BATCH]))
                if digest.count:
                    self._check(name, digest)
            if read_rest(r, what):
                raise DeltaError(f"{what}: longer than its base file")

    def _sparse_ok(self, unit: PlainUnit | ModuleUnit | None, name: str | None) -> bool:
        """Whether the served tensor gives the stored bits back exactly (element-wise path)."""
        if not isinstance(unit, PlainUnit) or unit.rounded:
            return False
        stored = to_torch(np.zeros(0, self.served.tensors[name].dtype)).dtype
        live = unit.tensor.dtype
        return stored == live or (live == torch.float32 and stored in (torch.bfloat16, torch.float16))

    def _apply_sparse(self, unit: PlainUnit, info: TensorInfo, t_idx: np.ndarray,
                      xor: np.ndarray) -> np.ndarray:
        """Stage the changed elements of a plain tensor; return their new stored bits."""
        dev = unit.tensor.device
        idx = torch.from_numpy(t_idx).to(dev)
        old_live = unit.tensor.view(-1).index_select(0, idx)
        stored = to_torch(np.zeros(0, info.dtype)).dtype
        old_bits = as_int(old_live.to(stored)).cpu().numpy()
        new_bits = old_bits.view(xor.dtype) ^ xor
        new_live = torch.from_numpy(new_bits.view(old_bits.dtype)).view(stored).to(dev).to(unit.tensor.dtype)
        self.stage.add(unit.key, unit.tensor, 0, idx, as_int(old_live), as_int(new_live), unit.copies)
        return new_bits

    def _check(self, name: str, digest: ChangeDigest) -> None:
        rec = self.records.get(name)
        if rec is None or int(rec["changed"]) != digest.count or rec["sha256"] != digest.hexdigest():
            raise DeltaError(f"the changes of {name} do not match {DELTA_NAME} (corrupt)")
        self.done.add(name)

    def rebuild(self) -> None:
        """Apply the gathered whole-tensor changes: KV scales, then each unit at a time."""
        for name in [n for n in self.changes if n in self.kv]:
            i, j = self.kv[name]
            info = self.served.tensors[name]
            old = np.asarray(self.scales[i][j], info.dtype).reshape(info.shape)
            new = self._xor(name, old)
            pair = list(self.scales[i])
            pair[j] = kv_scale_value(new, name, self.where)
            self.scales[i] = tuple(pair)
        todo = [u for u in self.units.units
                if self.changes.keys() & set(u.stored if isinstance(u, ModuleUnit) else [u.name])]
        for unit in todo:
            stored = unit.stored if isinstance(unit, ModuleUnit) else [unit.name]
            arrays = self._old(unit, stored)
            for name in stored:
                if name in self.changes:
                    arrays[name] = self._xor(name, arrays[name])
            stage_unit(self.stage, self.units, unit, MemorySource(self.where, arrays))

    def _old(self, unit: PlainUnit | ModuleUnit, stored: list[str]) -> dict[str, np.ndarray]:
        """The served version's stored tensors of ``unit`` (private copies)."""
        parts = unit.module.stored_parts() if isinstance(unit, ModuleUnit) else None
        if parts is not None:
            return {f"{unit.name}.{s}": a for s, a in parts.items()}
        d = self.served.full_dir
        if d is None:
            raise DeltaError(f"{unit.name} is served in a form its stored bytes cannot be "
                             f"recovered from (recipe {self.units.recipe.name!r}) and v"
                             f"{self.served.version} was itself applied in place: load the "
                             "materialized directory")
        t = self.served.tensors
        src = FileSource(d, lambda n: (d / t[n].rel, t[n].begin, t[n].end),
                         lambda n: (t[n].dtype, t[n].shape), self.served.digests)
        return {n: src.array(n) for n in stored}

    def _xor(self, name: str, old: np.ndarray) -> np.ndarray:
        flat = old.reshape(-1).view(np.dtype(f"<u{old.dtype.itemsize}"))
        digest = ChangeDigest()
        for idx, xor in self.changes.pop(name):
            flat[idx] ^= xor
            digest.update(idx, flat[idx])
        self._check(name, digest)
        return old


__all__ = ["plan_delta"]
