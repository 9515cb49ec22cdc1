"""``mixrl-convert``: weight formats and checkpoints from the command line.

Commands::

    mixrl-convert import   --hf DIR --out CKPT            HF safetensors -> mixrl orbax checkpoint
    mixrl-convert export   --checkpoint CKPT --out DIR [--format F] [--config HF --step N]
                                                          orbax / training ckpt -> HF dir
    mixrl-convert quantize --in HF_DIR --format F --out DIR           HF -> quantized HF dir
    mixrl-convert publish  --in SRC --root ROOT --version V --format F [--format F ...] [--delta]
    mixrl-convert materialize --root ROOT --version V --format F --out DIR
                                                          a full HF dir from a delta chain
    mixrl-convert verify   DIR                            manifest, shards, tensors vs config
                                                          (a published version dir: each format)
    mixrl-convert inspect  DIR [--against HF_DIR]         per-tensor dequantization error

Every write is atomic (temp directory + rename): on any error nothing is left behind. Errors
print one clear message on stderr and exit with status 1 (2 for usage errors).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from convert.formats import ENGINES, FORMATS

EXIT_ERROR = 1


def _console(stderr: bool = True):
    from rich.console import Console

    return Console(stderr=stderr, highlight=False)


@contextmanager
def _progress(label: str, total: int | None, enabled: bool = True) -> Iterator[Callable]:
    """A rich progress bar over tensors; yields ``advance(name, nbytes)``."""
    if not enabled:
        yield lambda name, nbytes: None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[gb]:.2f} GB"), TimeElapsedColumn(),
                  TimeRemainingColumn(), TextColumn("{task.fields[tensor]}"),
                  console=_console(), transient=False) as bar:
        task = bar.add_task(label, total=total, gb=0.0, tensor="")
        done = [0]

        def advance(name: str, nbytes: int) -> None:
            done[0] += nbytes
            bar.update(task, advance=1, gb=done[0] / 1e9, tensor=name)

        yield advance


def _count_tensors(hf_config: dict) -> int | None:
    from convert.qwen3_config import Qwen3Config, hf_tensor_shapes

    try:
        return len(hf_tensor_shapes(Qwen3Config.from_hf_dict(hf_config)))
    except ValueError:
        return None


def _counted(tensors, advance):
    for name, arr in tensors:
        yield name, arr
        advance(name, arr.nbytes)


# ---------------------------------------------------------------------------------------------
# Commands


def cmd_import(args: argparse.Namespace) -> int:
    from convert.export import checked_tensors
    from convert.hf_checkpoint import HFCheckpoint
    from convert.orbax_io import save_orbax
    from convert.qwen3_config import Qwen3Config

    hf = HFCheckpoint(args.hf)
    if hf.config.get("quantization_config"):
        raise ValueError(f"{args.hf}: config.json has a quantization_config; import needs "
                         "full-precision (bf16/fp16/fp32) weights")
    cfg = Qwen3Config.from_hf_dict(hf.config)
    with _progress("import", _count_tensors(hf.config), not args.quiet) as advance:
        out = save_orbax(args.out, _counted(checked_tensors(hf.tensors(), cfg), advance),
                         hf.config, copy_files_from=args.hf, overwrite=args.overwrite)
    _console().print(f"wrote orbax checkpoint {out}", soft_wrap=True)
    return 0


def _export(src: str, out: str, fmt: str, args: argparse.Namespace, label: str) -> int:
    from convert.export import export_hf
    from convert.sources import load_config, open_source

    config = load_config(args.config) if getattr(args, "config", None) else None
    source = open_source(src, config, step=getattr(args, "step", None))
    if source.files_dir is None and getattr(args, "config", None) and Path(args.config).is_dir():
        source.files_dir = Path(args.config)  # tokenizer files beside the run's config
    kv_scales = _kv_scales(args, src)
    with _progress(label, _count_tensors(source.hf_config), not args.quiet) as advance:
        path = export_hf(source.open(), source.hf_config, out, fmt,
                         copy_files_from=source.files_dir, max_shard_bytes=args.max_shard_bytes,
                         overwrite=args.overwrite, progress=advance, kv_scales=kv_scales,
                         engines=args.engines, strict=args.strict, layout=args.layout)
    _console().print(f"wrote {fmt} export {path}", soft_wrap=True)
    return 0


def _kv_scales(args: argparse.Namespace, src) -> dict | None:
    """FP8 KV-cache scales calibrated on ``--kv-calibration`` ids (HF directory sources)."""
    ids_path = getattr(args, "kv_calibration", None)
    if not ids_path:
        return None
    from convert.hf_checkpoint import CONFIG_NAME
    from convert.kv_calibration import calibrate_kv_scales, load_calibration_ids

    if not (Path(src) / CONFIG_NAME).is_file() or not list(Path(src).glob("*.safetensors")):
        raise ValueError("--kv-calibration needs an HF directory as input (the sampler model "
                         "is loaded from it)")
    return calibrate_kv_scales(src, load_calibration_ids(ids_path))


def cmd_export(args: argparse.Namespace) -> int:
    return _export(args.checkpoint, args.out, args.format, args, "export")


def cmd_quantize(args: argparse.Namespace) -> int:
    return _export(args.input, args.out, args.format, args, f"quantize {args.format}")


def cmd_publish(args: argparse.Namespace) -> int:
    from convert.publish import publish
    from convert.sources import open_source

    source = open_source(args.input)
    total = _count_tensors(source.hf_config)
    formats = list(dict.fromkeys(args.format))
    with _progress("publish " + ",".join(formats), total and total * len(formats),
                   not args.quiet) as advance:
        report: dict = {}
        paths = publish(args.input, None, args.root, args.version, formats,
                        keep_last=args.keep_last, max_shard_bytes=args.max_shard_bytes,
                        kv_scales=_kv_scales(args, args.input),
                        progress=lambda fmt, name, n: advance(f"{fmt}:{name}", n),
                        delta=args.delta, full_every=args.full_every, report=report)
    for fmt, path in paths.items():
        r = report[fmt]
        how = (f"delta against v{r['delta_base']}, {r['bytes']:,} bytes of {r['full_bytes']:,} "
               f"({100 * r['bytes'] / max(r['full_bytes'], 1):.1f} %)" if r["delta_base"] is not None
               else f"full, {r['bytes']:,} bytes")
        _console().print(f"published {fmt}: {path} ({how})", soft_wrap=True)
    return 0


def cmd_materialize(args: argparse.Namespace) -> int:
    from convert.delta import materialize
    from convert.store import open_store

    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise FileExistsError(f"{out} already exists (pass --overwrite to replace it)")
    how = materialize(open_store(args.root), args.version, args.format, out)
    _console().print(f"materialized v{args.version} {args.format} into {out} ({how}; every file "
                     "verified against the manifest)", soft_wrap=True)
    return 0


def _print_verify(result) -> bool:
    """Print one ``verify_dir`` outcome (a report, or the VerifyError); return whether it passed."""
    from convert.verify import VerifyError

    if isinstance(result, VerifyError):
        console = _console()
        console.print(f"[red]FAILED[/red] {result.path}")
        for problem in result.problems:
            console.print(f"  {problem}", markup=False, soft_wrap=True)
        return False
    _console(stderr=False).print(
        f"OK {result.path}: format {result.format}, {result.model_type}, {result.tensors} "
        f"tensors in {result.files} file(s)", soft_wrap=True)
    return True


def cmd_verify(args: argparse.Namespace) -> int:
    from convert.publish import version_formats
    from convert.verify import VerifyError, verify_dir, verify_version

    kwargs = dict(manifest=not args.no_manifest, hashes=not args.no_hashes)
    formats = version_formats(args.dir)
    if formats:
        # A published version is verified whole: a sampler group loads several of its formats,
        # and "is v12 intact?" is the question asked of it. Exit 1 if any format fails.
        _console().print(f"{args.dir} is a published version directory holding formats "
                         f"{', '.join(formats)}: verifying each", soft_wrap=True)
        results = verify_version(args.dir, **kwargs)
        passed = [_print_verify(r) for r in results.values()]
        return 0 if all(passed) else EXIT_ERROR
    try:
        result = verify_dir(args.dir, **kwargs)
    except VerifyError as e:
        result = e
    return 0 if _print_verify(result) else EXIT_ERROR


def cmd_inspect(args: argparse.Namespace) -> int:
    from rich.table import Table

    from convert.inspection import iter_stats
    from convert.publish import describe_published

    for path in (args.dir, args.against):
        # A version directory holds one export per format: which one to inspect is the user's
        # choice, so name them rather than fail on its missing config.json.
        published = path and describe_published(path)
        if published:
            raise ValueError(published)
    rows = list(iter_stats(args.dir, args.against))
    if args.json:
        Path(args.json).write_text(json.dumps([r.as_dict() for r in rows], indent=1) + "\n")
    table = Table(title=f"{args.dir}" + (f" vs {args.against}" if args.against else ""))
    for col in ("tensor", "stored", "amax", "rms", "zeros"):
        table.add_column(col, justify="left" if col in ("tensor", "stored") else "right",
                         no_wrap=True)
    if args.against:
        for col in ("max|err|", "rms err", "rel rms err"):
            table.add_column(col, justify="right", no_wrap=True)
    shown = sorted(rows, key=lambda r: -(r.rel_rms_err or 0))[: args.top] if args.top else rows
    for r in shown:
        cells = [r.name, r.stored, f"{r.amax:.4g}", f"{r.rms:.4g}", f"{r.zero_fraction:.3f}"]
        if args.against:
            cells += [f"{r.max_abs_err:.3g}", f"{r.rms_err:.3g}", f"{r.rel_rms_err:.3g}"]
        table.add_row(*cells)
    console = _console(stderr=False)
    console.width = max(console.width, 160)  # tensor names are long; never wrap them
    console.print(table)
    if args.against and rows:
        worst = max(rows, key=lambda r: r.rel_rms_err or 0)
        console.print(f"worst relative RMS error: {worst.rel_rms_err:.4g} ({worst.name})")
    return 0


# ---------------------------------------------------------------------------------------------
# Parser


def build_parser() -> argparse.ArgumentParser:
    from convert.compressed_tensors import LAYOUTS, SCHEMES

    formats = list(FORMATS)
    # fp8_channel exists only in the compressed-tensors layout (get_codec says so otherwise)
    layout_formats = formats + [f for f in SCHEMES if f not in FORMATS]
    parser = argparse.ArgumentParser(
        prog="mixrl-convert",
        description="Weight formats and checkpoints for mixrl: HF safetensors <-> orbax, "
                    "quantized exports (" + ", ".join(formats) + "), manifests, verification.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common_write(p: argparse.ArgumentParser) -> None:
        p.add_argument("--overwrite", action="store_true",
                       help="replace an existing output (swapped in only when complete)")
        p.add_argument("--quiet", action="store_true", help="no progress bar")

    def shard_size(p: argparse.ArgumentParser) -> None:
        p.add_argument("--max-shard-bytes", type=int, default=2 * 1024**3,
                       help="maximum safetensors shard size in bytes (default 2 GiB)")

    def serving_shapes(p: argparse.ArgumentParser) -> None:
        p.add_argument("--engines", choices=ENGINES, default="serving",
                       help="serving (default): a projection whose shape the format's serving "
                            "kernels refuse stays bf16 and is listed in the config's ignore "
                            "lists; mixrl: quantize every projection (partial edge blocks, "
                            "loaded by the mixrl engine only)")
        p.add_argument("--layout", choices=LAYOUTS, default="native",
                       help="tensor names and config: this project's per-format layout "
                            "(default), or compressed-tensors (vLLM / llm-compressor; formats "
                            f"{', '.join(SCHEMES)})")
        p.add_argument("--strict", action="store_true",
                       help="refuse (one line naming the tensor and the rule) instead of "
                            "keeping an unservable projection in bf16")

    def kv_calibration(p: argparse.ArgumentParser) -> None:
        p.add_argument("--kv-calibration", metavar="IDS",
                       help="token ids [B, T] (.npy or JSON) to calibrate per-layer FP8 KV-cache "
                            "scales (k_scale/v_scale) on; needs an HF directory input")

    p = sub.add_parser("import", help="HF safetensors directory -> mixrl orbax checkpoint",
                       description="Read an HF Qwen3/Qwen3-MoE directory tensor by tensor and "
                       "write the orbax checkpoint the trainer starts from (HF-named tensors "
                       "under params/, config.json, tokenizer files).")
    p.add_argument("--hf", required=True, metavar="DIR", help="HF directory (bf16/fp32)")
    p.add_argument("--out", required=True, metavar="CKPT", help="checkpoint directory to create")
    common_write(p)
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("export", help="orbax/training checkpoint -> HF directory in a format",
                       description="Export a mixrl orbax checkpoint, a trainer training "
                       "checkpoint (params only) or an HF directory as an HF directory in one "
                       "weight format, with manifest.json.")
    p.add_argument("--checkpoint", required=True, metavar="CKPT",
                   help="mixrl orbax checkpoint (from import), trainer training checkpoint "
                        "directory (needs --config), or HF directory")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--format", default="bf16", choices=layout_formats)
    p.add_argument("--config", metavar="HF_CONFIG",
                   help="config.json or HF directory (required for a training checkpoint, "
                        "whose tokenizer files are then taken from that directory)")
    p.add_argument("--step", type=int, help="training checkpoint step (default: latest)")
    shard_size(p)
    serving_shapes(p)
    common_write(p)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("quantize", help="HF bf16 directory -> quantized HF directory",
                       description="Quantize an HF directory into one weight format, tensor by "
                       "tensor, with the serving stacks' config and a manifest.")
    p.add_argument("--in", dest="input", required=True, metavar="HF_DIR")
    p.add_argument("--format", required=True, choices=layout_formats)
    p.add_argument("--out", required=True, metavar="DIR")
    shard_size(p)
    serving_shapes(p)
    kv_calibration(p)
    common_write(p)
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser("publish", help="write version V in several formats under ROOT",
                       description="Publish ROOT/vVVVVVVVV/{format}/ atomically from an HF "
                       "directory or orbax checkpoint, update ROOT/LATEST, keep the newest "
                       "--keep-last versions.")
    p.add_argument("--in", dest="input", required=True, metavar="SRC")
    p.add_argument("--root", required=True)
    p.add_argument("--version", required=True, type=int)
    p.add_argument("--format", action="append", required=True, choices=formats,
                   help="repeat for several formats")
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--delta", action="store_true",
                   help="write each format as a delta against the previous version under ROOT "
                        "(a full snapshot when there is none, or every --full-every versions)")
    p.add_argument("--full-every", type=int, default=10, metavar="N",
                   help="with --delta: a full snapshot every N versions (default 10)")
    shard_size(p)
    kv_calibration(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_publish)

    p = sub.add_parser("materialize", help="a full HF directory of version V from ROOT",
                       description="Write version V of format F under ROOT (a directory or an "
                       "fsspec URL) as a full HF directory, applying its delta chain from the "
                       "newest full snapshot, byte-identical to a full publish of the same "
                       "weights and verified against its manifest.")
    p.add_argument("--root", required=True)
    p.add_argument("--version", required=True, type=int)
    p.add_argument("--format", required=True, choices=formats)
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--overwrite", action="store_true", help="replace an existing DIR")
    p.set_defaults(func=cmd_materialize)

    p = sub.add_parser("verify", help="check manifest, shards and tensors against the config",
                       description="Exit 0 if DIR is complete and intact; otherwise print every "
                       "problem (each naming its file) and exit 1.")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--no-manifest", action="store_true",
                   help="skip manifest checks (directories not written by mixrl)")
    p.add_argument("--no-hashes", action="store_true", help="check sizes but not sha256")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("inspect", help="per-tensor dequantization statistics",
                       description="Dequantize every weight of DIR and print statistics; with "
                       "--against, the error against a reference HF directory.")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--against", metavar="HF_DIR", help="reference directory (e.g. the bf16 one)")
    p.add_argument("--json", metavar="FILE", help="also write all rows as JSON")
    p.add_argument("--top", type=int, default=0,
                   help="show only the N tensors with the largest relative error")
    p.set_defaults(func=cmd_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from convert.delta import DeltaError
    from convert.store import StoreError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        _console().print("interrupted; no partial output was left")
        return 130
    except (ValueError, OSError, KeyError, DeltaError, StoreError) as e:
        # Our errors (checkpoint, safetensors, quantization, export, manifest, config) are
        # ValueErrors with a message naming the file or tensor; OSError covers missing paths.
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        _console().print(f"[red]mixrl-convert {args.command}: error:[/red] {msg}",
                         markup=True, highlight=False, soft_wrap=True)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
