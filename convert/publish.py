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

from convert.atomic import atomic_directory, atomic_write_text
from convert.export import export_hf
from convert.formats import FORMATS, get_codec
from convert.hf_checkpoint import CONFIG_NAME, DEFAULT_MAX_SHARD_BYTES
from convert.qwen3_config import Qwen3Config
from convert.sources import Source, open_source

LATEST = "LATEST"
VERSION_FILE = "version.json"
_VERSION_DIR = re.compile(r"^v(\d{8,})$")
#: called after each source tensor is converted for a format: (format, hf_name, source bytes)
PublishProgress = Callable[[str, str, int], None]


def version_dirname(version: int) -> str:
    if not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be a non-negative int, got {version!r}")
    return f"v{version:08d}"


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
    present = [f for f in FORMATS if (p / f / CONFIG_NAME).is_file()]
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


def prune_versions(out_root: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` versions; return the removed paths."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    root = Path(out_root)
    removed = []
    for v in list_versions(root)[:-keep_last]:
        path = root / version_dirname(v)
        aside = root / f".{path.name}.deleting-{os.getpid()}-{threading.get_ident()}"
        try:
            os.replace(path, aside)
        except FileNotFoundError:  # removed concurrently
            continue
        shutil.rmtree(aside, ignore_errors=True)
        removed.append(path)
    return removed


class _End:
    def __init__(self, exc: BaseException | None = None):
        self.exc = exc


def _fan_out_exports(source: Source, formats: Sequence[str], stage: Path, export_kwargs: dict,
                     progress: PublishProgress | None) -> None:
    """Run one export per format, each fed from a shared single pass over the source."""

    def progress_for(fmt: str):
        return None if progress is None else (lambda name, n: progress(fmt, name, n))

    if len(formats) == 1:
        fmt = formats[0]
        export_hf(source.open(), source.hf_config, stage / fmt, fmt,
                  progress=progress_for(fmt), **export_kwargs)
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
                      progress=progress_for(fmt), **export_kwargs)
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


def publish(params_or_checkpoint, config: Mapping | Qwen3Config | None, out_root: str | os.PathLike,
            version: int, formats: Iterable[str] = ("bf16",), *, keep_last: int | None = 3,
            tokenizer_dir: str | os.PathLike | None = None,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
            kv_scales: Mapping[int, tuple[float, float]] | None = None,
            input_amax: Mapping[str, float] | None = None,
            progress: PublishProgress | None = None) -> dict[str, Path]:
    """Publish weights as ``out_root/v{version:08d}/{format}/``; return ``{format: path}``.

    ``params_or_checkpoint``: a callable returning an iterator of ``(hf_name, float array)``
    (e.g. ``lambda: iter_hf_tensors(model)``), a mapping or one-shot iterable of such pairs, an
    HF directory, or a mixrl orbax checkpoint directory. ``config``: the HF config dict or
    ``Qwen3Config`` (``None`` to use the directory's). ``keep_last``: keep this many newest
    versions (``None``: keep all). Raises ``FileExistsError`` if the version exists; on any
    error nothing of the new version is visible.
    """
    formats = list(dict.fromkeys(formats))
    if not formats:
        raise ValueError("no formats to publish")
    for fmt in formats:
        get_codec(fmt)  # unknown names fail before any work
    name = version_dirname(version)
    source = open_source(params_or_checkpoint, config)
    root = Path(out_root)
    final = root / name
    export_kwargs = dict(copy_files_from=tokenizer_dir or source.files_dir,
                         max_shard_bytes=max_shard_bytes, kv_scales=kv_scales,
                         input_amax=input_amax, metadata={"version": version})
    with atomic_directory(final) as stage:
        _fan_out_exports(source, formats, stage, export_kwargs, progress)
        (stage / VERSION_FILE).write_text(json.dumps(
            {"version": version, "formats": formats, "created_unix": round(time.time(), 3)},
            indent=2) + "\n")
    atomic_write_text(root / LATEST, name + "\n")
    if keep_last is not None:
        prune_versions(root, keep_last)
    return {fmt: final / fmt for fmt in formats}
