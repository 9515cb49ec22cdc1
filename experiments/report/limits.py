"""Stability limits for ``mixrl-train plan --limits`` from a sweep report's tables (issue 39, item 4).

    python -m experiments.report.limits docs/results_dial.md --out docs/results/limits_dial.yaml

Reads the report's "Per condition and pool" table (mean k3, mean out-of-range share, reward
collapse and KL alarm per cell) and its growth table (each seed's growth label and collapses,
held-out ones included) -- the committed figures, since the run directories are not kept -- and
writes the largest mean k3 and out-of-range share at which *corrected* cells (a condition with MIS)
stayed bounded: every seed finished, no seed's k3 labelled growth, no collapse of any kind, no KL
alarm. Each limit names the cell it came from; corrected cells that were not bounded are listed
too, since the true threshold lies between. Staleness and k3 growth get no limit: the dial runs
are synchronous (staleness 0) and growth is what "bounded" already selects on.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

import yaml

WARNING = ("a 64-wide model on a CPU (2 layers, logit noise as the mismatch, 24 synchronous RL steps, "
           "2 seeds) says little about FP8 / NVFP4 at 8B: use these limits for runs like those, and "
           "measure before trusting them elsewhere")


def read_tables(text: str) -> dict[str, list[dict[str, str]]]:
    """Every markdown table of ``text`` under its ``## `` heading, rows as {column: cell}."""
    tables: dict[str, list[dict[str, str]]] = {}
    heading, header, rows = "", None, None
    for line in [*text.splitlines(), ""]:
        if line.startswith("## "):
            heading = line[3:].strip()
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells is None:
            if header and rows is not None:
                tables.setdefault(heading, rows)
            header, rows = None, None
        elif header is None:
            header = cells
        elif rows is None:
            rows = []  # the |---| line
        else:
            rows.append(dict(zip(header, cells, strict=False)))
    return tables


def _table(tables: dict[str, list[dict]], prefix: str, columns: tuple[str, ...], report: Path) -> list[dict]:
    for heading, rows in tables.items():
        if heading.startswith(prefix) and rows and all(c in rows[0] for c in columns):
            return rows
    raise ValueError(f"{report}: no '{prefix}' table with columns {', '.join(columns)}")


def _num(cell: str) -> float:
    try:
        return float(cell)
    except ValueError:
        return math.nan


def cells(report: Path) -> list[dict]:
    """One record per (condition, pool): mean k3 and out-of-range, bounded or why not."""
    tables = read_tables(report.read_text())
    main = _table(tables, "Per condition and pool",
                  ("condition", "pool", "seeds", "collapse at step", "KL alarm at", "mean k3",
                   "mean out-of-range"), report)
    growth = {(r["condition"], r["pool"]): r for r in _table(
        tables, "Growth of the mismatch", ("condition", "pool", "per seed", "collapses"), report)}
    out = []
    for r in main:
        g = growth.get((r["condition"], r["pool"]), {})
        done, planned = (int(x) for x in r["seeds"].split("/"))
        why = []
        if done < planned:
            why.append(f"{done}/{planned} seeds finished")
        if r["collapse at step"] != "none":
            why.append(f"reward collapse at step {r['collapse at step']}")
        if r["KL alarm at"] != "none":
            why.append(f"KL alarm at step {r['KL alarm at']}")
        if re.search(r"\bgrowth\b", g.get("per seed", "")):
            why.append(f"k3 growth ({g['per seed']})")
        if g.get("collapses", "none") != "none":
            why.append(f"collapse: {g['collapses']}")
        out.append({"condition": r["condition"], "pool": r["pool"], "seeds": r["seeds"],
                    "k3": _num(r["mean k3"]), "out_of_range": _num(r["mean out-of-range"]),
                    "corrected": "MIS" in r["condition"], "bounded": not why, "why": "; ".join(why)})
    return out


def limits_from(reports: list[Path], command: str) -> dict:
    """The limits file's content from one or more reports' corrected cells."""
    rows = [dict(c, report=str(p)) for p in reports for c in cells(p)]
    corrected = [c for c in rows if c["corrected"]]
    bounded = [c for c in corrected if c["bounded"]]
    if not bounded:
        raise ValueError(f"{', '.join(map(str, reports))}: no corrected cell stayed bounded; "
                         "no limit to write")

    def label(c: dict) -> str:
        return f"{c['condition']} / {c['pool']} ({c['seeds']} seeds, {c['report']})"

    doc: dict = {
        "source": (f"mixrl sweep report(s) {', '.join(map(str, reports))}: the largest mean k3 and "
                   "out-of-range share at which corrected (MIS) runs stayed bounded"),
        "warning": WARNING,
        "generated_by": command,
    }
    for key in ("k3", "out_of_range"):
        top = max((c for c in bounded if not math.isnan(c[key])), key=lambda c: c[key])
        doc[f"max_{key}"] = top[key]
    doc.update(max_k3_ratio=None, max_k3_growth=None, max_staleness=None, max_probe_kl=None)
    doc["runs"] = {
        "bounded": [f"{label(c)}: k3 {c['k3']:.3g}, out-of-range {c['out_of_range']:.4f}" for c in bounded],
        "not bounded": [f"{label(c)}: k3 {c['k3']:.3g}, out-of-range {c['out_of_range']:.4f}: {c['why']}"
                        for c in corrected if not c["bounded"]],
    }
    top_k3 = max(bounded, key=lambda c: c["k3"])
    top_oor = max(bounded, key=lambda c: c["out_of_range"])
    doc["notes"] = (f"max_k3 from {label(top_k3)}; max_out_of_range from {label(top_oor)}. No limit on "
                    "staleness (the dial runs are synchronous: staleness 0), k3 growth (what 'bounded' "
                    "selects on), the k3 ratio or probe KL (not in the reports).")
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.report.limits",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="*", default=["docs/results_dial.md"], help="sweep report markdown(s)")
    ap.add_argument("--out", default="docs/results/limits_dial.yaml")
    args = ap.parse_args(argv)
    reports = [Path(r) for r in args.reports]
    command = "python -m experiments.report.limits " + " ".join([*args.reports, "--out", args.out])
    try:
        doc = limits_from(reports, command)
    except (OSError, ValueError) as e:
        print(f"experiments.report.limits: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# Generated by `{command}`; do not edit by hand.\n"
                   "# Stability limits for mixrl-train plan --limits (experiments/plan_solve.py).\n"
                   + yaml.safe_dump(doc, sort_keys=False, width=100, allow_unicode=True))
    print(f"wrote {out}: max_k3 {doc['max_k3']:.3g}, max_out_of_range {doc['max_out_of_range']:.4f} "
          f"({len(doc['runs']['bounded'])} bounded corrected cells, {len(doc['runs']['not bounded'])} not)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
