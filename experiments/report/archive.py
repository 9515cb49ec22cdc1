"""Keep a sweep's small outputs in the repository, so ``docs/results.md`` can be regenerated after
the run directories (weights, checkpoints, sampler caches: gigabytes, under the ignored ``runs/``)
are gone — as happened to issue 20's sweeps, whose documents could no longer be rebuilt.

    python -m experiments.report.archive runs/ablation_long docs/results_long/runs \\
        --command "runs/ablation_long/run.sh (five mixrl-train sweep invocations)"

Per cell ``{pool}/{condition}/seed{N}`` it copies what ``report.runs.collect`` reads:
``metrics.jsonl`` (whole, gzipped: ``runs.run_metrics`` reads it), ``cell.json`` (absolute paths
under the repository made relative, so the config it names resolves from the repository root)
and ``summary.json`` cut to the held-out pass rates and step count; a cell still running is
copied without ``cell.json`` (the report lists it as started, not finished). Also each seed's
``warm_start/seed{N}.json`` (its time counts in the cell time), the warm start's weights
themselves when they are small (the demo-sized model's are ~0.3 MB; at most
``WARM_START_MAX_BYTES``), and ``sweep.json``. The destination's cells are replaced, so rerunning
refreshes the archive.

A grid too long for one sitting continues in another checkout from its archive:

    python -m experiments.report.archive --restore docs/results_decide/runs runs/ablation_decide

copies the archived warm start (the very weights every cell started from) and each finished
cell's record into the run directory, so ``mixrl-train sweep ... --out runs/ablation_decide``
skips those cells and runs only the rest from the same warm start.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
from pathlib import Path

from experiments.report.runs import ARCHIVED_METRICS

ROOT = Path(__file__).resolve().parents[2]
SUMMARY_KEYS = ("eval_start", "eval_end", "steps", "run_name")
#: a warm start's weights are archived only up to this size (tiny testbed models; never a real one)
WARM_START_MAX_BYTES = 4 * 1024**2


def _relative(value, root: str):
    """``value`` with the repository root prefix removed from every string in it."""
    if isinstance(value, str):
        return value.replace(root + os.sep, "")
    if isinstance(value, list):
        return [_relative(v, root) for v in value]
    if isinstance(value, dict):
        return {k: _relative(v, root) for k, v in value.items()}
    return value


def archive(src: str | os.PathLike, dst: str | os.PathLike, *, command: str | None = None) -> list[str]:
    """Copy the small outputs of every cell under ``src`` into ``dst``; returns the cells copied
    (``pool/condition/seedN``, `` (running)`` appended for a cell without ``cell.json``)."""
    src, dst = Path(src), Path(dst)
    root = str(ROOT)
    copied = []
    for cell in sorted(src.glob("*/*/seed*")):
        if cell.parent.parent.name == "warm_start" or not (cell / "metrics.jsonl").exists():
            continue
        rel = cell.relative_to(src)
        out = dst / rel
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        # mtime 0: an unchanged run archives to the same bytes (no spurious diff on a refresh)
        data = gzip.compress((cell / "metrics.jsonl").read_bytes(), mtime=0)
        (out / ARCHIVED_METRICS).write_bytes(data)
        if (cell / "summary.json").exists():
            summary = json.loads((cell / "summary.json").read_text())
            (out / "summary.json").write_text(
                json.dumps({k: summary[k] for k in SUMMARY_KEYS if k in summary}, indent=1) + "\n"
            )
        if (cell / "cell.json").exists():
            record = _relative(json.loads((cell / "cell.json").read_text()), root)
            (out / "cell.json").write_text(json.dumps(record, indent=2) + "\n")
            copied.append(str(rel))
        else:
            copied.append(f"{rel} (running)")
    for f in sorted((src / "warm_start").glob("seed*.json")):
        (dst / "warm_start").mkdir(parents=True, exist_ok=True)
        record = _relative(json.loads(f.read_text()), root)
        (dst / "warm_start" / f.name).write_text(json.dumps(record, indent=2) + "\n")
        weights = f.with_suffix("")
        if weights.is_dir() and sum(p.stat().st_size for p in weights.iterdir()) <= WARM_START_MAX_BYTES:
            _copy_dir(weights, dst / "warm_start" / weights.name)
    manifest = {}
    if (src / "sweep.json").exists():
        manifest = _relative(json.loads((src / "sweep.json").read_text()), root)
        manifest.pop("cells", None)  # the cells' own cell.json files are the record
    if command:  # also when no invocation has finished yet (no sweep.json to copy)
        manifest["command"] = command
    if manifest:
        dst.mkdir(parents=True, exist_ok=True)
        (dst / "sweep.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return copied


def _copy_dir(src: Path, dst: Path) -> None:
    """Replace ``dst`` with a copy of the flat directory ``src`` (written beside it, then renamed)."""
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)


def restore(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Put an archive's finished cells and warm starts back into a sweep's run directory ``dst``, so
    that the sweep skips them; a cell already finished in ``dst`` is left alone. Returns the cells
    restored. A cell archived while it was still running (no ``cell.json``) is not restored: the
    sweep runs it again."""
    src, dst = Path(src), Path(dst)
    restored = []
    for cell in sorted(src.glob("*/*/seed*")):
        if cell.parent.parent.name == "warm_start" or not (cell / "cell.json").exists():
            continue
        out = dst / cell.relative_to(src)
        done = out / "cell.json"
        if done.exists() and json.loads(done.read_text()).get("ok"):
            continue
        _copy_dir(cell, out)
        restored.append(str(cell.relative_to(src)))
    for item in sorted((src / "warm_start").glob("seed*")) if (src / "warm_start").is_dir() else []:
        target = dst / "warm_start" / item.name
        if item.is_dir() and not (target / "config.json").exists():
            _copy_dir(item, target)
        elif item.is_file() and not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(item, target)
    return restored


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.report.archive",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="the sweep's run directory (runs/...); with --restore, the archive")
    ap.add_argument("dst", help="where to keep its small outputs (docs/results_*/runs); with --restore, "
                    "the run directory to continue the sweep in")
    ap.add_argument("--command", default=None, help="the command that ran the sweep, for the report")
    ap.add_argument("--restore", action="store_true",
                    help="copy the archive's finished cells and warm starts back into a run directory")
    a = ap.parse_args(argv)
    if not Path(a.src).is_dir():
        print(f"error: {a.src} is not a directory")
        return 2
    if a.restore:
        for line in restore(a.src, a.dst):
            print(f"restored {line}")
        return 0
    for line in archive(a.src, a.dst, command=a.command):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
