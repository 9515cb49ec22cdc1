"""In-place weight reloads: a new version written into the tensors the engine serves.

``Engine.load_weights`` builds no second model. A reload has two phases.

*Stage* (``plan_dir`` for a full export, ``reload_delta.plan_delta`` for a delta), in the calling
thread while generation goes on. Only what changed is read: from a full export with a version-2
manifest, the tensors whose sha256 differs from the served version's (all of them when the
version served is loaded again -- the probe's repair path -- or when either manifest is a
version-1 one, whose files are then verified whole first); from a delta, the changed elements.
Each is verified (its sha256, or the delta's change digest), turned into what the recipe serves
(cast to the compute dtype, a quantized module built from its parts by ``make_linear``, the
``round_weights`` dial), and compared bit for bit with the served tensor, a piece of
``CHUNK_BYTES`` or one module at a time; the elements that differ are staged
(``sampler_torch.engine.stage``): in memory up to a budget, beyond it in an unlinked temp file.
Nothing served is written, so any failure -- a digest mismatch, a truncated file, a malformed
part, another architecture -- raises and leaves the served version intact.

*Apply* (``Plan.apply``), at a step boundary with generation stopped (the engine's pause): the
staged elements are written into the served tensors and their fused copies, and the norms'
derived rows are recomputed. Nothing is read from the export and nothing is verified there:
every byte written was verified before. We verify *before* writing rather than apply to a
scratch copy of one tensor at a time because a failure at tensor k of n would leave the new
version's first k tensors served beside the old one's others, with no way back short of keeping
a copy of each; staging the differences costs memory in proportion to what changed (a few % of
the model after an RL step), never a second model.

The fingerprint (``Engine.weights_digest``) stays exact: each tensor's ``tensor_sum`` is linear
in its elements, so the staged elements move it (``fingerprint.sum_change``) to what a fresh
load of the version computes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from convert.delta_codec import layout
from convert.formats import detect_format, module_of
from convert.hf_checkpoint import HFCheckpoint
from convert.manifest import (
    MANIFEST_NAME,
    ManifestError,
    check_manifest,
    read_manifest,
    tensor_digests,
    verify_files,
)
from sampler_torch.engine.fingerprint import digest_of, module_tensors, tensor_sum
from sampler_torch.engine.forward import EngineForward
from sampler_torch.engine.stage import Stage
from sampler_torch.recipes import LoadedModel, Recipe, RecipeError, WeightLoadError, torch_dtype
from sampler_torch.recipes.linear import make_linear
from sampler_torch.recipes.loader import (
    ExportLayout,
    check_names,
    check_part,
    check_plain,
    kv_scale_names,
    kv_scale_value,
)
from sampler_torch.recipes.rounding import round_blockwise, round_spec, rounds
from sampler_torch.tensors import to_torch

#: stored bytes compared at a time (bounds the temporaries of a comparison)
CHUNK_BYTES = 4 << 20
#: the staging budget: this share of the served tensors' bytes, at least ``MIN_BUDGET`` (the
#: served tensors are about 3/4 of a CPU engine's RSS: with the comparisons' temporaries a reload
#: stays within 1.1x; past it changes spill to a file the pause reads back from the page cache)
BUDGET_SHARE = 0.05
MIN_BUDGET = 8 << 20


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where a stored tensor of the served version lies in its export."""

    rel: str
    begin: int
    end: int
    dtype: np.dtype
    shape: tuple[int, ...]


@dataclasses.dataclass
class Served:
    """What the engine knows of the version it serves, carried from reload to reload."""

    version: int
    path: Path
    hf_config: dict
    manifest: dict | None
    #: sha256 of the manifest.json bytes (what a delta names as its base)
    manifest_sha: str | None
    #: per-tensor ``(file, sha256)`` of a version-2 manifest; None: none known
    digests: dict[str, tuple[str, str]] | None
    tensors: dict[str, TensorInfo]
    #: per safetensors file, ``convert.delta_codec.layout``'s regions (what a delta walks)
    regions: dict[str, list[tuple[int, int, int]]]
    #: a directory holding this version's files in full (None after a delta applied in place)
    full_dir: Path | None
    #: ``tensor_sum`` of every model tensor, by name (the fingerprint's terms)
    sums: dict[str, int]
    k_scales: list[float] | None
    v_scales: list[float] | None
    digest: str


@dataclasses.dataclass
class PlainUnit:
    """A stored tensor the model holds as one tensor in the compute dtype."""

    name: str
    tensor: torch.Tensor
    key: str | None
    copies: list[tuple[torch.Tensor, int]]
    rounded: bool


@dataclasses.dataclass
class ModuleUnit:
    """A quantized projection: a recipe module built from the stored parts ``stored``."""

    name: str
    module: nn.Module
    stored: list[str]
    keys: dict[str, str]
    rounded: bool


class Units:
    """How the served model holds each stored tensor (the model's tensors never change
    object: one map for the engine's life)."""

    def __init__(self, loaded: LoadedModel, fwd: EngineForward, recipe: Recipe, device: torch.device):
        self.recipe, self.device = recipe, device
        self.dtype = torch_dtype(recipe)
        self.spec = round_spec(recipe)
        self.lay = ExportLayout.of(loaded.hf_config, detect_format(loaded.hf_config))
        model = loaded.model
        self.tensors = module_tensors(model)
        key = {id(t): k for k, t in self.tensors.items()}
        copies = fwd.copies()
        params = dict(model.named_parameters(remove_duplicate=False))
        self.units: list[PlainUnit | ModuleUnit] = []
        self.of: dict[str, PlainUnit | ModuleUnit] = {}  # stored tensor name -> unit
        for name in self.lay.shapes:
            mname = module_of(name)
            if name in self.lay.quantized:
                module = model.get_submodule(mname)
                unit = ModuleUnit(mname, module, [f"{mname}.{s}" for s in self.lay.codec.parts],
                                  {b: key[id(t)] for b, t in module.named_buffers()},
                                  self.spec is not None and rounds(mname, module))
                names = unit.stored
            else:
                t = params[name]
                unit = PlainUnit(name, t, key.get(id(t)), copies.get(id(t), []),
                                 self.spec is not None and rounds(mname, model.get_submodule(mname)))
                names = [name]
            self.units.append(unit)
            self.of.update(dict.fromkeys(names, unit))
        fused = {id(c): c.nbytes for cs in copies.values() for c, _ in cs}
        #: bytes of every served tensor, fused copies included (the staging budget's base)
        self.bytes = sum(t.nbytes for t in self.tensors.values()) + sum(fused.values())

    def digest(self, sums: dict[str, int], k_scales: list[float] | None,
               v_scales: list[float] | None) -> str:
        """``module_fingerprint`` of the model with these sums (as a fresh load computes it)."""
        return digest_of(((k, tuple(t.shape), t.dtype, sums[k]) for k, t in self.tensors.items()),
                         (k_scales, v_scales))

    def budget(self) -> int:
        return max(MIN_BUDGET, int(BUDGET_SHARE * self.bytes))


# --------------------------------------------------------------------------- sources


class FileSource:
    """Stored tensors read from safetensors files a bounded piece at a time, each verified
    against its sha256 (``digests``; None: the files were verified whole already)."""

    def __init__(self, where: object, locate: Callable[[str], tuple[Path, int, int]],
                 info: Callable[[str], tuple[np.dtype, tuple[int, ...]]],
                 digests: dict[str, tuple[str, str]] | None):
        self.where, self.locate, self.info, self.digests = where, locate, info, digests

    def rows(self, name: str, rows_per: int, fresh: bool = False) -> Iterator[tuple[int, np.ndarray]]:
        """``(first row, flat array)`` of ``rows_per`` rows at a time (one buffer reused, or a
        new one per piece with ``fresh``)."""
        dtype, shape = self.info(name)
        path, begin, end = self.locate(name)
        row = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else max(1, int(np.prod(shape)))
        step = rows_per * row * dtype.itemsize
        h = hashlib.sha256() if self.digests is not None else None
        buf = bytearray(min(step, end - begin))
        with open(path, "rb", buffering=0) as f:
            for pos in range(begin, end, step):
                n = min(step, end - pos)
                view = memoryview(buf)[:n]
                if os.preadv(f.fileno(), [view], pos) != n:
                    raise WeightLoadError(f"{path}: truncated inside {name}")
                if h is not None:
                    h.update(view)
                yield (pos - begin) // (row * dtype.itemsize), np.frombuffer(view, dtype)
                if fresh:
                    buf = bytearray(min(step, end - pos - n))
        self._check(name, path, h)

    def array(self, name: str) -> np.ndarray:
        """The whole tensor (its own memory), verified."""
        dtype, shape = self.info(name)
        parts = [a for _, a in self.rows(name, max(1, shape[0] if shape else 1), fresh=True)]
        return (parts[0] if len(parts) == 1 else np.zeros(0, dtype)).reshape(shape)

    def _check(self, name: str, path: Path, h) -> None:
        if h is None:
            return
        want = self.digests.get(name)
        if want is None or h.hexdigest() != want[1]:
            raise WeightLoadError(f"{path}: {name}: sha256 does not match the manifest (corrupt)")


class MemorySource:
    """Stored tensors already in memory and verified (a delta applied to the served bytes)."""

    def __init__(self, where: object, arrays: dict[str, np.ndarray]):
        self.where, self.arrays = where, arrays

    def info(self, name: str) -> tuple[np.dtype, tuple[int, ...]]:
        return self.arrays[name].dtype, self.arrays[name].shape

    def rows(self, name: str, rows_per: int) -> Iterator[tuple[int, np.ndarray]]:
        a = self.arrays[name]
        flat = a.reshape(a.shape[0], -1) if a.ndim > 1 else a.reshape(1, -1)
        for r in range(0, flat.shape[0], rows_per):
            yield r, flat[r:r + rows_per].reshape(-1)

    def array(self, name: str) -> np.ndarray:
        return self.arrays[name]


Source = FileSource | MemorySource

# --------------------------------------------------------------------------- staging units


def stage_unit(stage: Stage, units: Units, unit: PlainUnit | ModuleUnit, src: Source) -> None:
    """Stage what the served tensors of ``unit`` become with the stored tensors of ``src``."""
    if isinstance(unit, PlainUnit):
        _stage_plain(stage, units, unit, src)
    else:
        _stage_module(stage, units, unit, src)


def _stage_plain(stage: Stage, units: Units, unit: PlainUnit, src: Source) -> None:
    dtype, shape = src.info(unit.name)
    check_plain(src.where, unit.name, dtype, shape, units.lay.shapes[unit.name])
    row = shape[-1] if len(shape) > 1 else int(np.prod(shape))
    # whole rows: the dial rounds blocks of a row, so rows can be rounded apart
    rows_per = max(1, CHUNK_BYTES // max(1, row * dtype.itemsize))
    with torch.no_grad():
        for r0, arr in src.rows(unit.name, rows_per):
            new = to_torch(arr).to(units.dtype).to(units.device)
            if unit.rounded:
                new = round_blockwise(new.view(-1, row), units.spec)
            stage.diff(unit.key, unit.tensor, r0 * row, new.reshape(-1), unit.copies)


def _stage_module(stage: Stage, units: Units, unit: ModuleUnit, src: Source) -> None:
    shape = units.lay.shapes[f"{unit.name}.weight"]
    parts = {}
    for suffix, spec in units.lay.codec.tensor_specs(shape).items():
        name = f"{unit.name}.{suffix}"
        check_part(src.where, name, *src.info(name), spec)
        parts[suffix] = src.array(name)
    try:
        built = make_linear(units.recipe, parts, units.device).to(units.device)
    except (ValueError, KeyError, RuntimeError) as e:
        raise WeightLoadError(f"{src.where}: cannot build {unit.name} ({type(e).__name__}: {e})") from e
    with torch.no_grad():
        if unit.rounded:
            built.weight.copy_(round_blockwise(built.weight, units.spec))
        new = dict(built.named_buffers())
        for bname, live in unit.module.named_buffers():
            b = new.get(bname)
            if b is None or b.shape != live.shape or b.dtype != live.dtype:
                raise WeightLoadError(f"{src.where}: {unit.name}.{bname} would change shape or "
                                      "dtype; an in-place reload keeps the served modules")
            stage.diff(unit.keys[bname], live, 0, b.reshape(-1))


# --------------------------------------------------------------------------- plans


@dataclasses.dataclass
class Plan:
    """A verified reload waiting for its pause: the staged writes and the state they lead to."""

    stage: Stage
    served: Served
    how: str
    read_tensors: int
    stage_s: float = 0.0

    def apply(self, fwd: EngineForward) -> None:
        self.stage.apply()
        fwd.rederive()


def kv_lists(values: dict[int, tuple[float | None, float | None]], layers: int
             ) -> tuple[list[float] | None, list[float] | None]:
    """Per-layer k and v scales as ``load_model`` returns them (None when no layer has one)."""
    k = [values.get(i, (None, None))[0] for i in range(layers)]
    v = [values.get(i, (None, None))[1] for i in range(layers)]
    if not any(s is not None for s in k):
        return None, None
    return [s or 1.0 for s in k], [s or 1.0 for s in v]


def describe(path: Path) -> tuple[dict[str, TensorInfo], dict[str, list[tuple[int, int, int]]]]:
    """``(tensors, regions)`` of the export at ``path`` (headers only)."""
    ckpt = HFCheckpoint(path)
    tensors = {}
    for name in ckpt.names():
        rel, begin, end = ckpt.locate(name)
        dtype, shape = ckpt.info(name)
        tensors[name] = TensorInfo(rel, begin, end, np.dtype(dtype), tuple(shape))
    regions = {}
    for rel in ckpt.files():
        lay = layout(path / rel)
        if lay is not None:
            regions[rel] = lay[1]
    return tensors, regions


def manifest_sha(path: Path) -> str | None:
    try:
        return hashlib.sha256((path / MANIFEST_NAME).read_bytes()).hexdigest()
    except OSError:
        return None


def served_at_load(loaded: LoadedModel, units: Units, version: int) -> Served:
    """The state of a version loaded by ``load_model`` (the engine's first load)."""
    tensors, regions = describe(loaded.path)
    sums = {k: tensor_sum(t) for k, t in units.tensors.items()}
    return Served(version, loaded.path, dict(loaded.hf_config), loaded.manifest,
                  manifest_sha(loaded.path) if loaded.manifest is not None else None,
                  tensor_digests(loaded.manifest) if loaded.manifest is not None else None,
                  tensors, regions, loaded.path, sums, loaded.k_scales, loaded.v_scales,
                  units.digest(sums, loaded.k_scales, loaded.v_scales))


def _verified_manifest(path: Path) -> dict:
    """The export's manifest, its sizes checked; a version-1 manifest's files hashed whole
    (nothing finer to verify them by), a version-2 one's small files the engine reads."""
    try:
        manifest = read_manifest(path)
    except ManifestError as e:
        raise WeightLoadError(f"{path}: refusing to load, the export does not match its manifest: "
                              f"{e}") from None
    whole = tensor_digests(manifest) is None
    problems = check_manifest(path, hashes=whole)
    if not whole and not problems:
        small = {rel: (e["size"], e["sha256"]) for rel, e in manifest["files"].items()
                 if rel.endswith(".json")}
        problems = verify_files(path, small)
    if problems:
        raise WeightLoadError(f"{path}: refusing to load, the export does not match its manifest: "
                              + "; ".join(problems))
    return manifest


def check_export(path: Path, hf_config: dict, units: Units) -> ExportLayout:
    """The layout of an export with ``hf_config``, refused unless the served model can take it
    in place (same format, architecture and quantized projections)."""
    try:
        codec = detect_format(hf_config)
    except ValueError as e:
        raise WeightLoadError(f"{path}: cannot read the export ({e})") from e
    if codec.layout != "native":
        raise WeightLoadError(f"{path} is in the {codec.layout} layout, which vLLM loads; the mixrl "
                              "engine loads this project's native layout (export without --layout)")
    if codec.name != units.recipe.weight_format:
        raise RecipeError(f"{path} holds {codec.name} weights; recipe {units.recipe.name!r} needs "
                          f"{units.recipe.weight_format} (export that format for this group)")
    lay = ExportLayout.of(hf_config, codec)
    if lay.cfg != units.lay.cfg:
        raise WeightLoadError(f"{path}: architecture differs from the served model "
                              f"({lay.cfg} vs {units.lay.cfg})")
    if lay.quantized != units.lay.quantized:
        raise WeightLoadError(f"{path}: the export quantizes other projections than the served "
                              "model (its ignore lists differ); a new Engine must load it")
    return lay


def plan_dir(served: Served, units: Units, path: str | os.PathLike, version: int, *,
             budget: int | None = None) -> Plan:
    """Stage the full export at ``path`` as ``version`` against ``served`` (see the module doc)."""
    path = Path(path)
    manifest = _verified_manifest(path)
    try:
        ckpt = HFCheckpoint(path)
    except (ValueError, OSError) as e:
        raise WeightLoadError(f"{path}: cannot read the export ({e})") from e
    lay = check_export(path, ckpt.config, units)
    names = set(ckpt.names())
    check_names(path, lay, names)
    digests = tensor_digests(manifest)
    if digests is not None and names - set(digests):
        raise WeightLoadError(f"{path}: the manifest lists no sha256 of {sorted(names - set(digests))[:3]}")
    fresh = digests is None or served.digests is None or int(version) == served.version
    changed = names if fresh else {n for n in names
                                   if served.digests.get(n, ("", ""))[1] != digests[n][1]}
    try:
        src = FileSource(path, lambda n: (path / ckpt.locate(n)[0], *ckpt.locate(n)[1:]),
                         ckpt.info, digests)
        stage = Stage(budget or units.budget(), served.sums)
        for unit in units.units:
            stored = [unit.name] if isinstance(unit, PlainUnit) else unit.stored
            if changed.intersection(stored):
                stage_unit(stage, units, unit, src)
        scales = {}
        for i in range(lay.cfg.num_hidden_layers):
            pair = [None, None]
            for j, which in enumerate("kv"):
                name = next((n for n in kv_scale_names(i, which) if n in names), None)
                if name is not None:
                    pair[j] = kv_scale_value(src.array(name), name, path)
            scales[i] = tuple(pair)
    except (ValueError, KeyError, OSError) as e:  # safetensors / codec errors
        raise WeightLoadError(f"{path}: cannot load the export ({type(e).__name__}: {e})") from e
    k, v = kv_lists(scales, lay.cfg.num_hidden_layers)
    tensors, regions = describe(path)
    new = Served(int(version), path, dict(ckpt.config), manifest, manifest_sha(path), digests,
                 tensors, regions, path, stage.sums, k, v, units.digest(stage.sums, k, v))
    how = f"{len(changed)} of {len(names)} tensors read" + ("" if digests else " (files verified whole)")
    return Plan(stage, new, how, len(changed))


__all__ = ["BUDGET_SHARE", "CHUNK_BYTES", "FileSource", "MemorySource", "ModuleUnit", "Plan", "PlainUnit",
           "Served", "TensorInfo", "Units", "check_export", "kv_lists", "plan_dir", "served_at_load",
           "stage_unit"]
