"""Keep a sweep's small outputs in the repository, so ``docs/results.md`` can be regenerated after
the run directories (weights, checkpoints, sampler caches: gigabytes, under the ignored ``runs/``)
are gone — as happened to issue 20's sweeps, whose documents could no longer be rebuilt.

    python -m trainer_jax.report.archive runs/ablation_long docs/results_long/runs \\
        --command "runs/ablation_long/run.sh (five mixrl-train sweep invocations)"

Per cell ``{pool}/{condition}/seed{N}`` it copies what ``report.runs.collect`` reads:
``metrics.jsonl`` (whole, gzipped: ``runs.run_metrics`` reads it), ``cell.json`` (absolute paths
under the repository made relative, so the config it names resolves from the repository root)
and ``summary.json`` cut to the held-out pass rates and step count; a cell still running is
copied without ``cell.json`` (the report lists it as started, not finished). Also each seed's
``warm_start/seed{N}.json`` (its time counts in the cell time) and ``sweep.json``. The
destination's cells are replaced, so rerunning refreshes the archive.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
from pathlib import Path

from trainer_jax.report.runs import ARCHIVED_METRICS

ROOT = Path(__file__).resolve().parents[2]
SUMMARY_KEYS = ("eval_start", "eval_end", "steps", "run_name")


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer_jax.report.archive",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="the sweep's run directory (runs/...)")
    ap.add_argument("dst", help="where to keep its small outputs (docs/results_*/runs)")
    ap.add_argument("--command", default=None, help="the command that ran the sweep, for the report")
    a = ap.parse_args(argv)
    if not Path(a.src).is_dir():
        print(f"error: {a.src} is not a directory")
        return 2
    for line in archive(a.src, a.dst, command=a.command):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
