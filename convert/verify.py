"""``verify``: is an exported directory complete, intact and exactly what its config needs?

Checks, in order, each problem naming the file it concerns:

1. ``manifest.json``: every listed file exists with the listed size and sha256, and no
   unlisted file is present (skippable for directories that never had a manifest).
2. ``config.json`` parses as a Qwen3 / Qwen3-MoE config and its ``quantization_config`` names a
   known format.
3. The index and every shard header are consistent (a truncated shard fails here even without
   a manifest).
4. Every tensor the config needs is present with the format's dtype and shape: quantized
   projections as the codec's ``tensor_specs``, everything else as a float tensor of the HF
   shape; optional per-layer ``k_scale``/``v_scale`` scalars are allowed; anything else is an
   unexpected tensor.

A published version directory (``out_root/v00000042/``, one HF directory per format) is not
one export: ``verify_dir`` refuses it naming its formats, ``verify_version`` checks each.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
from pathlib import Path

import numpy as np

from convert.formats import detect_format, excluded_modules, module_of, stores_quantized
from convert.formats.numerics import BF16
from convert.hf_checkpoint import CONFIG_NAME, CheckpointError, HFCheckpoint
from convert.manifest import check_manifest
from convert.publish import describe_published, version_formats
from convert.qwen3_config import ConfigError, Qwen3Config, hf_tensor_shapes
from convert.safetensors_io import SafetensorsError, SafetensorsFile

_FLOATS = {np.dtype(np.float32), np.dtype(np.float16), BF16}
_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.[kv]_scale$")


class VerifyError(ValueError):
    """A directory failed verification; ``problems`` lists every finding."""

    def __init__(self, path: Path, problems: list[str]):
        self.path, self.problems = path, problems
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        super().__init__(f"{path}: verification failed ({len(problems)} problem(s)):\n  "
                         f"{shown}{more}")


@dataclasses.dataclass
class VerifyReport:
    path: Path
    format: str
    model_type: str
    tensors: int
    files: int


def _check_headers(path: Path) -> list[str]:
    problems = []
    for f in sorted(path.glob("*.safetensors")):
        try:
            SafetensorsFile(f)
        except (SafetensorsError, OSError) as e:
            problems.append(str(e))
    return problems


def verify_dir(path: str | os.PathLike, *, manifest: bool = True,
               hashes: bool = True) -> VerifyReport:
    """Verify ``path``; return a report or raise ``VerifyError`` listing every problem."""
    path = Path(path)
    if not path.is_dir():
        raise VerifyError(path, [f"{path}: not a directory"])
    published = describe_published(path)
    if published:  # one clear finding instead of "manifest.json/config.json missing"
        raise VerifyError(path, [published])
    problems: list[str] = []
    if manifest:
        problems += check_manifest(path, hashes=hashes)
    config_path = path / CONFIG_NAME
    try:
        config = json.loads(config_path.read_text())
        cfg = Qwen3Config.from_hf_dict(config)
        codec = detect_format(config)
    except FileNotFoundError:
        raise VerifyError(path, problems + [f"{config_path}: missing"]) from None
    except (json.JSONDecodeError, UnicodeDecodeError, ConfigError, ValueError) as e:
        raise VerifyError(path, problems + [f"{config_path}: {e}"]) from None
    header_problems = _check_headers(path)
    if header_problems:
        raise VerifyError(path, problems + header_problems)
    try:
        ckpt = HFCheckpoint(path)
    except (CheckpointError, SafetensorsError) as e:
        raise VerifyError(path, problems + [str(e)]) from None

    wmap = ckpt._weight_map  # name -> file, to name the file in each finding
    expected: dict[str, tuple[set[np.dtype] | np.dtype, tuple[int, ...]]] = {}
    excluded = excluded_modules(config)  # projections a mixed export keeps in bf16
    for name, shape in hf_tensor_shapes(cfg).items():
        if stores_quantized(name, config, excluded):
            for suffix, (dtype, part_shape) in codec.tensor_specs(shape).items():
                expected[f"{module_of(name)}.{suffix}"] = (dtype, part_shape)
        else:
            expected[name] = (_FLOATS, shape)
    for name, (dtype, shape) in expected.items():
        if name not in wmap:
            problems.append(f"{path}: tensor {name!r} is missing (format {codec.name})")
            continue
        try:
            got_dtype, got_shape = ckpt.info(name)
        except (CheckpointError, SafetensorsError, KeyError) as e:
            problems.append(str(e))
            continue
        ok_dtype = got_dtype in dtype if isinstance(dtype, set) else got_dtype == dtype
        if not ok_dtype or tuple(got_shape) != tuple(shape):
            want = "a float dtype" if isinstance(dtype, set) else str(dtype)
            problems.append(f"{path / wmap[name]}: tensor {name!r} is {got_dtype}{list(got_shape)}"
                            f", format {codec.name} needs {want}{list(shape)}")
    for name in wmap:
        if name in expected:
            continue
        m = _KV_SCALE.match(name)
        if m and int(m.group(1)) < cfg.num_hidden_layers:
            dtype, shape = ckpt.info(name)
            if dtype == np.float32 and shape in ((), (1,)):
                continue
        problems.append(f"{path / wmap[name]}: unexpected tensor {name!r} for a "
                        f"{cfg.model_type} model in format {codec.name}")
    if problems:
        raise VerifyError(path, problems)
    return VerifyReport(path, codec.name, cfg.model_type, len(wmap), len(ckpt.files()))


def _verify_format(version_dir: Path, fmt: str, **kwargs) -> VerifyReport:
    """``verify_dir`` of one format of a version; a delta (``convert.delta``) is checked as the
    full directory it materializes to (applied from its chain in a temp directory)."""
    from convert.delta import DELTA_NAME, DeltaError, materialize
    from convert.store import open_store

    target = version_dir / fmt
    if not (target / DELTA_NAME).is_file():
        return verify_dir(target, **kwargs)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            version = int(version_dir.absolute().name.lstrip("v"))
            materialize(open_store(version_dir.absolute().parent), version, fmt, Path(tmp) / fmt)
        except (DeltaError, ValueError) as e:
            raise VerifyError(target, [f"{target}: {e}"]) from None
        return dataclasses.replace(verify_dir(Path(tmp) / fmt, **kwargs), path=target)


def verify_version(path: str | os.PathLike, *, manifest: bool = True,
                   hashes: bool = True) -> dict[str, VerifyReport | VerifyError]:
    """``verify_dir`` every format of the published version directory ``path``.

    Returns ``{format: report or the VerifyError}`` for each format ``version.json`` lists or a
    subdirectory holds (a listed format whose directory is gone fails as "not a directory"; a
    directory holding another format than its name fails too). Raises ``VerifyError`` if
    ``path`` is not a version directory.
    """
    path = Path(path)
    formats = version_formats(path)
    if not formats:
        raise VerifyError(path, [f"{path}: not a published version directory"])
    results: dict[str, VerifyReport | VerifyError] = {}
    for fmt in formats:
        try:
            report = _verify_format(path, fmt, manifest=manifest, hashes=hashes)
        except VerifyError as e:
            results[fmt] = e
            continue
        if report.format != fmt:
            results[fmt] = VerifyError(report.path, [f"{report.path}: holds format "
                                                     f"{report.format}, not {fmt}"])
        else:
            results[fmt] = report
    return results
