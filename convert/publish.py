"""``publish``: write weight version v in every format a sampler group needs, atomically.

Layout under ``out_root``::

    out_root/v00000042/version.json      {"version": 42, "formats": [...], "created_unix": ...}
    out_root/v00000042/bf16/             HF directory + manifest.json
    out_root/v00000042/fp8_block/        HF directory + manifest.json (+ hf_quant_config.json
    ...                                  for nvfp4)
    out_root/LATEST                      "v00000042\\n", rewritten (atomically) after the rename

The version directory is built under a temp name and renamed into place when every format is
complete, so a sampler polling ``out_root`` sees a version whole or not at all; then ``LATEST``
is updated and versions older than the newest ``keep_last`` are removed (renamed aside first,
so no reader ever sees a half-deleted directory; readers with open files keep them).

The source is read once: each source tensor is handed to one export thread per format, so
a trainer's device-to-host copy happens once per tensor whatever the number of formats.

With ``delta=True`` a format whose previous version exists is written as a delta against it
(``convert.delta``): the full export goes to a local cache (the next version's base) and only
what changed goes to the store; a full snapshot every ``full_every`` versions, and whenever the
base is missing or unreadable. ``out_root`` may be an fsspec URL (``convert.store``): the version
is staged locally, uploaded under a temporary prefix and committed by writing ``LATEST`` last.
Pruning keeps every base a kept delta needs, never the version just published nor the one
``LATEST`` names.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

from convert.atomic import atomic_directory
from convert.calibration import Calibration
from convert.delta import DELTA_NAME, DeltaError, encode_delta, materialize, read_step
from convert.export import export_hf
from convert.formats import FORMATS, get_codec
from convert.hf_checkpoint import CONFIG_NAME, DEFAULT_MAX_SHARD_BYTES
from convert.qwen3_config import Qwen3Config
from convert.sources import Source, open_source
from convert.store import LATEST, VERSION_FILE, Store, open_store, version_dirname

_VERSION_DIR = re.compile(r"^v(\d{8,})$")
#: called after each source tensor is converted for a format: (format, hf_name, source bytes)
PublishProgress = Callable[[str, str, int], None]


def list_versions(out_root: str | os.PathLike) -> list[int]:
    """Published version numbers under ``out_root``, ascending."""
    root = Path(out_root)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir()
                  if p.is_dir() and (m := _VERSION_DIR.match(p.name)))


def latest_version(out_root: str | os.PathLike) -> Path | None:
    """The directory ``LATEST`` points to, or ``None`` before the first publish."""
    pointer = Path(out_root) / LATEST
    if not pointer.is_file():
        return None
    return Path(out_root) / pointer.read_text().strip()


def version_formats(path: str | os.PathLike) -> list[str] | None:
    """The formats of the published version directory ``path``; ``None`` if it is not one.

    A version directory (``out_root/v00000042/``) holds ``version.json`` and one HF directory per
    format but no ``config.json`` itself; commands meant for one format directory use this to
    say what to point them at instead of failing on a missing ``config.json``. The formats are
    those ``version.json`` lists plus any format subdirectory present (a damaged version may
    lack either), in the order published.
    """
    p = Path(path)
    # Only what publish writes counts (its version.json or its vNNNNNNNN name), so that an
    # arbitrary directory that happens to hold an export named bf16/ is not taken for one.
    if (not p.is_dir() or (p / CONFIG_NAME).exists()
            or not ((p / VERSION_FILE).is_file() or _VERSION_DIR.match(p.absolute().name))):
        return None
    listed: list[str] = []
    try:
        meta = json.loads((p / VERSION_FILE).read_text())
        listed = [f for f in meta["formats"] if isinstance(f, str)] if isinstance(
            meta["formats"], list) else []
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no or unreadable version.json: fall back to the subdirectories
    present = [f for f in FORMATS
               if (p / f / CONFIG_NAME).is_file() or (p / f / DELTA_NAME).is_file()]
    formats = list(dict.fromkeys(listed + present))
    return formats or None


def describe_published(path: str | os.PathLike) -> str | None:
    """One line for a publish root or version directory given where one format's is expected.

    Such a path holds no ``config.json`` of its own, so readers would report just that; this
    says what the path is, which formats it holds, and which directory to use instead. ``None``
    for any other path.
    """
    p = Path(path)
    formats = version_formats(p)
    if formats:
        return (f"{p} is a published version directory holding formats {', '.join(formats)}: "
                f"point at one format directory, e.g. {p / formats[0]}")
    versions = list_versions(p)
    newest = latest_version(p)
    if newest is None and not versions:
        return None
    newest = newest or p / version_dirname(versions[-1])
    formats = version_formats(newest) or []
    return (f"{p} is a publish root ({len(versions)} version(s); {newest.name} has formats "
            f"{', '.join(formats) or 'none'}): point at one format directory, e.g. "
            f"{newest / (formats[0] if formats else 'FORMAT')}")


def _needed_bases(store: Store, version: int) -> set[int]:
    """The versions a delta of ``version`` is built on (every format), from its version.json."""
    try:
        meta = json.loads(store.read_text(f"{version_dirname(version)}/{VERSION_FILE}") or "{}")
        return {int(b) for b in (meta.get("deltas") or {}).values()}
    except (ValueError, TypeError, AttributeError):
        return set()


def prune_versions(out_root: str | os.PathLike | Store, keep_last: int,
                   protect: Iterable[int] = ()) -> list[int]:
    """Delete all but the newest ``keep_last`` versions; return the removed version numbers.

    Never removed: the versions in ``protect``, the one ``LATEST`` names, and (transitively)
    every base a kept delta version is built on, so whatever is kept can still be materialized.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    store = out_root if isinstance(out_root, Store) else open_store(out_root)
    versions = store.versions()
    keep = set(versions[-keep_last:]) | set(protect)
    if (latest := store.latest()) is not None:
        keep.add(latest)
    todo = [v for v in keep if v in versions]
    while todo:
        for base in _needed_bases(store, todo.pop()):
            if base not in keep:
                keep.add(base)
                todo.append(base)
    return [v for v in versions if v not in keep and store.remove_version(v)]


class _End:
    def __init__(self, exc: BaseException | None = None):
        self.exc = exc


def _fan_out_exports(source: Source, formats: Sequence[str], stage: Path,
                     export_kwargs: Mapping[str, dict], progress: PublishProgress | None) -> None:
    """Run one export per format (``export_kwargs[format]``: its ``export_hf`` options), each
    fed from a shared single pass over the source."""

    def progress_for(fmt: str):
        return None if progress is None else (lambda name, n: progress(fmt, name, n))

    if len(formats) == 1:
        fmt = formats[0]
        export_hf(source.open(), source.hf_config, stage / fmt, fmt,
                  progress=progress_for(fmt), **export_kwargs[fmt])
        return

    queues = [queue.Queue(maxsize=2) for _ in formats]
    errors: list[BaseException | None] = [None] * len(formats)

    def feed(q: queue.Queue) -> Iterator:
        while True:
            item = q.get()
            if isinstance(item, _End):
                if item.exc is not None:
                    raise item.exc
                return
            yield item

    def work(i: int, fmt: str) -> None:
        try:
            export_hf(feed(queues[i]), source.hf_config, stage / fmt, fmt,
                      progress=progress_for(fmt), **export_kwargs[fmt])
        except BaseException as e:  # noqa: BLE001 - re-raised by the publishing thread
            errors[i] = e

    threads = [threading.Thread(target=work, args=(i, f), name=f"mixrl-publish-{f}", daemon=True)
               for i, f in enumerate(formats)]
    for t in threads:
        t.start()

    def put(i: int, item) -> None:
        while threads[i].is_alive():
            try:
                queues[i].put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    end = _End()
    try:
        for item in source.open():
            for i in range(len(formats)):
                put(i, item)
            if any(e is not None for e in errors):
                end = _End(RuntimeError("publish aborted: another format's export failed"))
                break
    except BaseException as e:  # the source failed: abort every export
        end = _End(e)
    for i in range(len(formats)):
        put(i, end)
    for t in threads:
        t.join()
    if end.exc is not None and not isinstance(end.exc, RuntimeError):
        raise end.exc
    for e in errors:
        if e is not None and not (isinstance(e, RuntimeError) and "publish aborted" in str(e)):
            raise e
    if end.exc is not None:
        raise end.exc


def _calibrated(common: dict, fmt: str, calibration: Calibration | None,
                kv_cache_formats: set[str]) -> dict:
    """``export_hf`` options of format ``fmt``: ``common`` plus what ``calibration`` sets in it
    (and says so in its manifest); ``common`` itself when it sets nothing, so an export without
    calibration is exactly what it was before calibration existed."""
    if calibration is None:
        return common
    inputs = get_codec(fmt).calibrated_inputs and bool(calibration.input_amax)
    kv = fmt in kv_cache_formats and bool(calibration.kv_amax)
    if not (inputs or kv):
        return common
    out = dict(common)
    if inputs:
        out["input_amax"] = dict(calibration.input_amax)
    if kv:
        out["kv_scales"] = calibration.kv_scales()
    out["metadata"] = {**common["metadata"],
                       "calibration": calibration.record(input_scales=inputs, kv_scales=kv)}
    return out


def _depth(store: Store, version: int, fmt: str) -> int:
    """Deltas since the last full snapshot at ``version`` (0: it is one)."""
    meta = read_step(store, version, fmt)
    return 0 if meta is None else int(meta["depth"])


def default_cache_dir(store: Store) -> Path:
    """Where publish keeps each format's newest full export (the next delta's base)."""
    if store.local is not None:
        return store.local / ".publish-cache"
    import hashlib
    import tempfile

    key = hashlib.sha256(store.root.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "mixrl-publish-cache" / key


def _base_dir(store: Store, cache: Path, base: int, fmt: str, work: Path) -> Path:
    """A local full directory of version ``base`` of ``fmt``: the cache's, else materialized."""
    cached = cache / fmt
    if (cache / f"{fmt}.version").is_file() and \
            (cache / f"{fmt}.version").read_text().strip() == str(base) and cached.is_dir():
        return cached
    out = work / f"base-{fmt}"
    materialize(store, base, fmt, out)  # a trainer restarted, or weights trained elsewhere
    return out


def _stage_formats(store: Store, formats: Sequence[str], version: int, work: Path, stage: Path,
                   cache: Path, full_every: int, report: dict | None) -> dict[str, int]:
    """Write each format of the full exports in ``work`` into ``stage``: as a delta against the
    previous version where there is one, else in full. Return ``{format: base}`` of the deltas."""
    previous = [v for v in store.versions() if v < version]
    deltas: dict[str, int] = {}
    for fmt in formats:
        full_bytes = sum(p.stat().st_size for p in (work / fmt).rglob("*") if p.is_file())
        base = next((v for v in reversed(previous)
                     if store.exists(f"{version_dirname(v)}/{fmt}/{DELTA_NAME}")
                     or store.exists(f"{version_dirname(v)}/{fmt}/manifest.json")), None)
        written = None
        if base is not None:
            try:
                depth = _depth(store, base, fmt) + 1
                if depth < full_every:
                    written = encode_delta(work / fmt, _base_dir(store, cache, base, fmt, work),
                                           stage / fmt, version=version, base_version=base,
                                           depth=depth)
                    deltas[fmt] = base
            except (DeltaError, OSError, ValueError):
                shutil.rmtree(stage / fmt, ignore_errors=True)  # base unusable: publish in full
                written = None
        if written is None:
            shutil.copytree(work / fmt, stage / fmt, copy_function=_link_or_copy)
            written = full_bytes
        if report is not None:
            report[fmt] = {"bytes": written, "full_bytes": full_bytes, "delta_base": deltas.get(fmt)}
    return deltas


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # exports are never modified in place: sharing inodes is safe
    except OSError:
        shutil.copyfile(src, dst)


def _update_cache(cache: Path, work: Path, formats: Sequence[str], version: int) -> None:
    """Keep this version's full exports as the next version's bases."""
    cache.mkdir(parents=True, exist_ok=True)
    for fmt in formats:
        (cache / f"{fmt}.version").unlink(missing_ok=True)  # the pair is invalid until both move
        aside = cache / f".{fmt}.old-{os.getpid()}-{threading.get_ident()}"
        if (cache / fmt).exists():
            os.replace(cache / fmt, aside)
        os.replace(work / fmt, cache / fmt)
        shutil.rmtree(aside, ignore_errors=True)
        (cache / f"{fmt}.version").write_text(f"{version}\n")


def publish(params_or_checkpoint, config: Mapping | Qwen3Config | None, out_root: str | os.PathLike,
            version: int, formats: Iterable[str] = ("bf16",), *, keep_last: int | None = 3,
            tokenizer_dir: str | os.PathLike | None = None,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
            kv_scales: Mapping[int, tuple[float, float]] | None = None,
            input_amax: Mapping[str, float] | None = None,
            progress: PublishProgress | None = None, delta: bool = False, full_every: int = 10,
            cache_dir: str | os.PathLike | None = None,
            report: dict | None = None, engines: str = "serving",
            calibration: Calibration | None = None,
            kv_cache_formats: Iterable[str] = (),
            extra_json: Mapping[str, Mapping] | None = None) -> dict[str, Path | str]:
    """Publish weights as ``out_root/v{version:08d}/{format}/``; return ``{format: path}``.

    ``params_or_checkpoint``: a callable returning an iterator of ``(hf_name, float array)``
    (e.g. ``lambda: iter_hf_tensors(model)``), a mapping or one-shot iterable of such pairs, an
    HF directory, or a mixrl orbax checkpoint directory. ``config``: the HF config dict or
    ``Qwen3Config`` (``None`` to use the directory's). ``keep_last``: keep this many newest
    versions (``None``: keep all). ``out_root``: a directory or an fsspec URL (then the paths
    returned are URLs). ``delta``: write each format as a delta against its previous version
    (a full snapshot every ``full_every`` versions); ``cache_dir`` keeps the full exports the
    next delta is computed against (default: ``out_root/.publish-cache``, or a temp directory
    for a URL). ``report``, if given, receives ``{format: {"bytes", "full_bytes",
    "delta_base"}}``. ``calibration`` (``convert.calibration``): every format whose codec takes
    calibrated inputs (nvfp4) gets its ``input_scale`` from it, and the formats in
    ``kv_cache_formats`` (those a group runs with an FP8 e4m3 KV cache) its ``k_scale`` /
    ``v_scale``; each export that took something records it in its manifest's ``calibration``.
    ``extra_json``: JSON files written into every format's directory (the version probe's
    ``probe.json``), hashed into its manifest and carried by deltas like the weights.
    Raises ``FileExistsError`` if the version exists; on any error nothing of the new version is
    visible.
    """
    formats = list(dict.fromkeys(formats))
    if not formats:
        raise ValueError("no formats to publish")
    for fmt in formats:
        get_codec(fmt)  # unknown names fail before any work
    if full_every < 1:
        raise ValueError(f"full_every must be >= 1, got {full_every}")
    name = version_dirname(version)
    source = open_source(params_or_checkpoint, config)
    store = open_store(out_root)
    if store.local is None and store.exists(name):
        raise FileExistsError(f"{store.root}/{name} already exists")
    common = dict(copy_files_from=tokenizer_dir or source.files_dir,
                  max_shard_bytes=max_shard_bytes, kv_scales=kv_scales, input_amax=input_amax,
                  metadata={"version": version}, extra_json=extra_json,
                  engines=engines)  # see export_hf: serving shapes, or "mixrl" only
    export_kwargs = {fmt: _calibrated(common, fmt, calibration, set(kv_cache_formats))
                     for fmt in formats}
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir(store)
    local_parent = store.local if store.local is not None else cache  # one publisher per root stages here
    local_parent.mkdir(parents=True, exist_ok=True)
    final = store.local / name if store.local is not None else local_parent / f".stage-{name}"
    if store.local is not None and final.exists():
        raise FileExistsError(f"{final} already exists (pass overwrite to replace it)")
    import tempfile

    work = Path(tempfile.mkdtemp(prefix=f".publish-{name}-", dir=local_parent)) if delta else None
    deltas: dict[str, int] = {}
    try:
        with atomic_directory(final, overwrite=store.local is None) as stage:
            if delta:
                _fan_out_exports(source, formats, work, export_kwargs, progress)
                deltas = _stage_formats(store, formats, version, work, stage, cache, full_every,
                                        report)
            else:
                _fan_out_exports(source, formats, stage, export_kwargs, progress)
                if report is not None:
                    for fmt in formats:
                        n = sum(p.stat().st_size for p in (stage / fmt).rglob("*") if p.is_file())
                        report[fmt] = {"bytes": n, "full_bytes": n, "delta_base": None}
            (stage / VERSION_FILE).write_text(json.dumps(
                {"version": version, "formats": formats, "created_unix": round(time.time(), 3),
                 **({"deltas": deltas} if deltas else {})}, indent=2) + "\n")
            if store.local is None:
                store.commit_version(stage, version)
        if store.local is None:
            shutil.rmtree(final, ignore_errors=True)
        # LATEST names what was just published, which exists now (a resumed run may publish a
        # lower number than versions left by the run it resumes: those must not win).
        store.write_latest(version)
        if delta:
            _update_cache(cache, work, formats, version)
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    if keep_last is not None:
        prune_versions(store, keep_last, protect={version})
    if store.local is None:
        return {fmt: f"{store.root.rstrip('/')}/{name}/{fmt}" for fmt in formats}
    return {fmt: final / fmt for fmt in formats}
