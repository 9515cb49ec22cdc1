"""``mixrl-train``: the console command. The experiment tools' subcommands run here; every other
command line goes to the trainer's (``trainer_jax.cli.main``) unchanged.

    mixrl-train sweep SWEEP.yaml [--quick] [--out DIR] [--report-only]   the ablation grid + report
    mixrl-train plan RUN_DIR --budget USD_PER_HOUR [--prices F] [--limits F] [--out plan.yaml]
    mixrl-train plot RUN_DIR                                   PNG plots of a run's metrics
    mixrl-train [--config C ...] | serve ... | sft ...         the trainer (trainer_jax/cli.py)

The dispatch lives above the trainer because these tools read run directories after the fact and
``trainer_jax`` never imports ``experiments``. Nothing heavy is imported before a subcommand is
chosen: the trainer's own command line loads exactly what it loaded before.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Run ``sweep`` / ``plan`` / ``plot`` here; anything else (``--help`` included, whose text
    lists these three) is ``trainer_jax.cli.main``'s, with the same argv."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "sweep":
        return sweep_main(argv[1:])
    if argv and argv[0] == "plan":  # experiments.plan: a sampler pool from a run's measurements
        from experiments.plan import plan_main

        return plan_main(argv[1:])
    if argv and argv[0] == "plot":
        return plot_main(argv[1:])
    from trainer_jax.cli import main as trainer_main

    return trainer_main(argv)


def plot_main(argv: list[str]) -> int:
    """``mixrl-train plot RUN_DIR``: the run's ``plots/*.png`` (what a run writes at its end)."""
    p = argparse.ArgumentParser(prog="mixrl-train plot", description="Write plots/*.png for a run directory.")
    p.add_argument("run_dir")
    args = p.parse_args(argv)
    from trainer_jax.diagnostics import plot_run

    try:
        paths = plot_run(args.run_dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"mixrl-train plot: {e}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


def sweep_main(argv: list[str]) -> int:
    """Run a sweep file's grid (or its ``quick`` subset) and write the report."""
    import shlex
    import time
    from pathlib import Path

    p = argparse.ArgumentParser(
        prog="mixrl-train sweep",
        description="Run the ablation grid of a sweep file (each cell its own mixrl-train process; a "
                    "failed cell is recorded, not fatal; finished cells are skipped on a rerun), then "
                    "write the report (docs/results.md + docs/results/*.png) from the run directories.")
    p.add_argument("sweep_file", help="sweep YAML, e.g. configs/ablation.yaml")
    p.add_argument("--quick", action="store_true", help="the file's reduced `quick` grid (CI smoke test)")
    p.add_argument("--out", help="directory of the runs (default: the file's `out`, or its quick.out)")
    p.add_argument("--report-only", action="store_true", help="only (re)generate the report from --out")
    p.add_argument("--report", default=None,
                   help="markdown to write (default docs/results.md; docs/results_quick.md with --quick)")
    p.add_argument("--no-report", action="store_true", help="run the grid, skip the report")
    p.add_argument("--no-drift", action="store_true", help="skip the drift analysis in the report")
    p.add_argument("--conditions", help="comma-separated subset of the conditions")
    p.add_argument("--pools", help="comma-separated subset of the pools")
    p.add_argument("--seeds", help="comma-separated seeds (overrides the file's)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="extra overrides for every cell, after the file's (e.g. run.steps=8)")
    # Intermixed: the key=value overrides may come after the options (argparse would reject them).
    args = p.parse_intermixed_args(argv)

    from experiments.sweep import SweepError, load_sweep, run_sweep

    try:
        spec = load_sweep(args.sweep_file).select(quick=args.quick)
        for key, table in (("conditions", spec.conditions), ("pools", spec.pools)):
            chosen = getattr(args, key)
            if chosen:
                names = [n.strip() for n in chosen.split(",") if n.strip()]
                unknown = set(names) - set(table)
                if unknown:
                    raise SweepError(f"unknown {key}: {sorted(unknown)} (have {sorted(table)})")
                setattr(spec, key, {n: table[n] for n in names})
        if args.seeds:
            spec.seeds = [int(x) for x in args.seeds.split(",")]
        if args.overrides:
            bad = [o for o in args.overrides if "=" not in o]
            if bad:
                raise SweepError(f"overrides must be key=value, got {bad}")
            spec.overrides = spec.overrides + list(args.overrides)
    except (SweepError, ValueError) as e:
        print(f"mixrl-train sweep: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else spec.out
    report = Path(args.report or ("docs/results_quick.md" if args.quick else "docs/results.md"))
    failed = 0
    if not args.report_only:
        command = "mixrl-train sweep " + " ".join(shlex.quote(a) for a in argv)
        t0 = time.perf_counter()
        try:
            manifest = run_sweep(spec, out, command=command, log=lambda m: print(m, flush=True))
        except RuntimeError as e:  # the shared warm start failed: no cell can run
            print(f"mixrl-train sweep: {e}", file=sys.stderr)
            return 1
        failed = sum(not c["ok"] for c in manifest["cells"])
        print(f"mixrl-train sweep: {len(manifest['cells']) - failed}/{len(manifest['cells'])} cells ok in "
              f"{time.perf_counter() - t0:.0f}s; runs in {out}", flush=True)
    elif not out.exists():
        print(f"mixrl-train sweep: --report-only: {out} does not exist", file=sys.stderr)
        return 2
    if not args.no_report:
        from experiments.report import write_report

        labels = spec.labels()
        path = write_report(out, report, labels=labels, with_drift=not args.no_drift,
                            log=lambda m: print(m, file=sys.stderr))
        print(f"mixrl-train sweep: report {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
