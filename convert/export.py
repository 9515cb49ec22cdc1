"""Streaming export of HF-named float tensors to an HF directory in one weight format.

``export_hf`` consumes ``(hf_name, array)`` pairs one at a time: projection weights go through
the format's codec, everything else (embeddings, lm_head, norms, MoE router) is cast to bf16.
Each tensor's name and shape are checked against the config as it arrives, and the set is
checked complete at the end, before anything becomes visible. Quantization of the next tensors
runs on a background thread while the current shard is written. The directory (shards, index,
``config.json`` with the format's ``quantization_config``, extra JSON files such as
``hf_quant_config.json``, tokenizer files, and ``manifest.json`` last) is built in a temp
directory that is renamed into place, so a reader never sees half an export.

Memory: the writer holds up to one shard (``max_shard_bytes``) of output plus the tensors in
flight, never the whole model.
"""

from __future__ import annotations

import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np

from convert.atomic import atomic_directory
from convert.formats import (
    Codec,
    get_codec,
    is_quantized_weight,
    module_of,
    shape_exclusions,
    unquantized_modules,
)
from convert.formats.numerics import QuantizationError, check_finite, to_bf16
from convert.hf_checkpoint import DEFAULT_MAX_SHARD_BYTES, write_hf_checkpoint
from convert.manifest import write_manifest
from convert.qwen3_config import Qwen3Config, hf_tensor_shapes

Tensors = Iterable[tuple[str, np.ndarray]]
#: called after each source tensor is converted: (hf_name, source bytes)
ProgressFn = Callable[[str, int], None]


# Tensors some checkpoints carry that are not parameters (recomputed on load): dropped.
_DROPPED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


class ExportError(ValueError):
    """The source tensors do not match the config (missing, unexpected or misshapen)."""


def kv_scale_names(layer: int) -> tuple[str, str]:
    """Where SGLang/vLLM read per-layer FP8 KV-cache scales."""
    p = f"model.layers.{layer}.self_attn"
    return f"{p}.k_scale", f"{p}.v_scale"


def ignore_list(cfg: Qwen3Config, kept: Mapping[str, str] | None = None) -> list[str]:
    """Modules an export leaves in bf16: the never-quantized ones plus ``kept`` projections
    (``shape_exclusions``), in model order."""
    names = unquantized_modules(cfg)
    return names + sorted(kept or (), key=_model_order)


def _model_order(module: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in module.split("."))


def output_config(hf_config: Mapping, codec: Codec, *, kv_cache_fp8: bool = False,
                  kept: Mapping[str, str] | None = None) -> dict:
    """The ``config.json`` of an export: the model config plus the format's block."""
    cfg = Qwen3Config.from_hf_dict(dict(hf_config))
    out = cfg.to_hf_dict()
    out.pop("quantization_config", None)
    out["torch_dtype"] = out["dtype"] = "bfloat16"
    qc = codec.quantization_config(ignore_list(cfg, kept), kv_cache_fp8=kv_cache_fp8)
    if qc is not None:
        out["quantization_config"] = qc
    return out


def checked_tensors(tensors: Tensors, cfg: Qwen3Config) -> Iterator[tuple[str, np.ndarray]]:
    """Pass ``tensors`` through, checking each name and shape against ``cfg`` as it arrives and
    that none is missing at the end (so a consumer fails before publishing anything)."""
    expected = hf_tensor_shapes(cfg)
    seen: set[str] = set()
    for name, arr in tensors:
        arr = np.asarray(arr)
        if _DROPPED.search(name) or (cfg.tie_word_embeddings and name == "lm_head.weight"):
            continue  # a recomputed buffer, or a tied lm_head some writers store anyway
        if name not in expected:
            raise ExportError(f"source tensor {name!r} is not part of a {cfg.model_type} model "
                              f"with this config")
        if name in seen:
            raise ExportError(f"source tensor {name!r} appears twice")
        if tuple(arr.shape) != expected[name]:
            raise ExportError(f"source tensor {name!r} has shape {tuple(arr.shape)}, the config "
                              f"says {expected[name]}")
        seen.add(name)
        yield name, arr
    missing = [n for n in expected if n not in seen]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ExportError(f"source lacks {len(missing)} tensor(s) the config needs: "
                          f"{', '.join(missing[:5])}{more}")


def convert_tensors(tensors: Tensors, cfg: Qwen3Config, codec: Codec, *,
                    kv_scales: Mapping[int, tuple[float, float]] | None = None,
                    input_amax: Mapping[str, float] | None = None,
                    progress: ProgressFn | None = None,
                    kept: Mapping[str, str] | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """Yield the export's tensors for each source tensor (names and shapes checked).

    ``kv_scales`` maps layer -> (k_scale, v_scale); ``input_amax`` maps a module name to its
    calibrated activation max (used by codecs with ``calibrated_inputs``, nvfp4's
    ``input_scale``; ignored by the others); ``kept``: projections written in bf16
    (``shape_exclusions``).
    """
    kept = kept or {}
    for name, arr in checked_tensors(tensors, cfg):
        if is_quantized_weight(name) and codec.name != "bf16" and module_of(name) not in kept:
            kwargs = {}
            if codec.calibrated_inputs and input_amax and module_of(name) in input_amax:
                kwargs["input_amax"] = input_amax[module_of(name)]
            prefix = module_of(name)
            for suffix, part in codec.quantize(arr, what=name, **kwargs).items():
                yield f"{prefix}.{suffix}", part
        else:
            check_finite(arr, name)
            yield name, to_bf16(arr)
        if progress is not None:
            progress(name, arr.nbytes)
    for layer, (k, v) in sorted((kv_scales or {}).items()):
        if not 0 <= layer < cfg.num_hidden_layers:
            raise ExportError(f"kv_scales for layer {layer}, model has {cfg.num_hidden_layers}")
        for scale_name, value in zip(kv_scale_names(layer), (k, v), strict=True):
            if not (np.isfinite(value) and value > 0):
                raise QuantizationError(f"{scale_name}: KV scale must be positive, got {value}")
            yield scale_name, np.asarray(value, np.float32).reshape(())


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


_DONE = object()


def prefetch(items: Iterator, depth: int = 2) -> Iterator:
    """Run ``items`` on a background thread, ``depth`` results ahead of the consumer.

    Exceptions from the producer re-raise in the consumer; if the consumer stops early the
    producer is told to stop at its next item.
    """
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(_DONE)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            put(_Failure(e))

    thread = threading.Thread(target=produce, name="mixrl-export-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is _DONE:
                return
            if isinstance(item, _Failure):
                raise item.exc
            yield item
    finally:
        stop.set()
        thread.join()


def export_hf(tensors: Tensors, hf_config: Mapping, out_dir: str | os.PathLike, fmt: str = "bf16",
              *, copy_files_from: str | os.PathLike | None = None,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, overwrite: bool = False,
              kv_scales: Mapping[int, tuple[float, float]] | None = None,
              input_amax: Mapping[str, float] | None = None,
              progress: ProgressFn | None = None, metadata: Mapping | None = None,
              engines: str = "serving", strict: bool = False, layout: str = "native",
              extra_json: Mapping[str, Mapping] | None = None) -> Path:
    """Write ``tensors`` as an HF directory in format ``fmt`` at ``out_dir``, atomically.

    ``engines="serving"``: projections whose shape the format's serving kernels refuse stay bf16
    and are listed in the config's ignore lists (``strict``: refuse with ``ShapeRuleError``
    instead); ``"mixrl"``: every projection in ``fmt`` (partial edge blocks, for this project's
    engine only). ``extra_json``: further JSON files to write beside the weights (``probe.json``),
    listed in the manifest like every file. ``layout="compressed-tensors"``: that layout's tensors and config
    (``convert.compressed_tensors``). Returns ``out_dir``. On any error (bad tensor, NaN/Inf,
    I/O) nothing is left behind and an existing ``out_dir`` (with ``overwrite``) is untouched.
    """
    codec = get_codec(fmt, layout)
    src = dict(hf_config)
    if src.get("quantization_config"):
        raise ExportError("the source config already has a quantization_config; export from "
                          "full-precision weights")
    cfg = Qwen3Config.from_hf_dict(src)
    kept = shape_exclusions(cfg, codec, engines=engines, strict=strict)
    config = output_config(src, codec, kv_cache_fp8=bool(kv_scales), kept=kept)
    extra = {**codec.extra_files(ignore_list(cfg, kept), kv_cache_fp8=bool(kv_scales)),
             **dict(extra_json or {})}
    out_dir = Path(out_dir)
    started = time.time()
    # Shards are hashed while they are written (write_file feeds a hasher on a second thread and
    # the per-tensor hashes of the manifest on a third): sha256 runs at ~1 GB/s per core, so a
    # separate pass would cost as much as the write.
    digests: list[tuple[str, dict[str, str]]] = []
    with atomic_directory(out_dir, overwrite=overwrite) as stage:

        def hash_shard(part: Path, sha256: str, tensor_sha256: dict[str, str]) -> None:
            digests.append((sha256, tensor_sha256))

        stream = convert_tensors(tensors, cfg, codec, kv_scales=kv_scales, input_amax=input_amax,
                                 progress=progress, kept=kept)
        # The stage directory exists (empty); write_hf_checkpoint builds its own temp beside it
        # and swaps it in, then the manifest is added and the whole stage is renamed to out_dir.
        fetched = prefetch(stream)
        try:
            write_hf_checkpoint(stage, fetched, config, max_shard_bytes=max_shard_bytes,
                                copy_files_from=copy_files_from, extra_json=extra,
                                overwrite=True, on_shard=hash_shard)
        finally:
            fetched.close()  # on error: stop the producer thread now, not at garbage collection
        known = {shard_name(i + 1, len(digests)): d for i, (d, _) in enumerate(digests)}
        known_tensors = {shard_name(i + 1, len(digests)): t for i, (_, t) in enumerate(digests)}
        if kept:  # why each bf16 projection is there, for people reading the manifest
            metadata = {**dict(metadata or {}), "kept_bf16": dict(kept)}
        if layout != "native":
            metadata = {**dict(metadata or {}), "layout": layout}
        write_manifest(stage, known=known, known_tensors=known_tensors, format=codec.name,
                       model_type=cfg.model_type, created_unix=round(started, 3),
                       **dict(metadata or {}))
    return out_dir


def shard_name(i: int, n: int) -> str:
    """The name ``write_hf_checkpoint`` gives shard ``i`` (1-based) of ``n``."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"
