"""`mixrl-train`: the trainer's command line.

    mixrl-train --config configs/local_mixed.yaml [key=value ...]   run the configured job
    mixrl-train serve|sft|plot|sweep ...                            (brought by later issues)
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.table import Table

from trainer_jax.config import ConfigError, load_config

# Subcommands the design names whose implementation lands with later work.
PLANNED = {
    "serve": "the standalone rollout service (gRPC wire issue)",
    "sft": "the supervised warm start (training-loop issue)",
    "plot": "run plots (training-loop issue)",
    "sweep": "the ablation sweep (reproduction issue)",
}


def _main_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mixrl-train",
        description="Train a policy from mixed-precision sampler groups. Without a subcommand, runs "
                    "the job the config describes. Subcommands: " + ", ".join(PLANNED) + ".")
    p.add_argument("--config", required=True, help="YAML run config (see configs/)")
    p.add_argument("--run-dir", help="output directory (overrides run.dir)")
    p.add_argument("--steps", type=int, help="number of steps (overrides run.steps)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. run.seed=3")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    console = Console()
    if argv and argv[0] in PLANNED:
        sub = argparse.ArgumentParser(prog=f"mixrl-train {argv[0]}", description=PLANNED[argv[0]])
        sub.parse_known_args(argv[1:])  # --help works; anything else is not built yet
        console.print(f"[red]mixrl-train {argv[0]}: not implemented yet[/red] ({PLANNED[argv[0]]})")
        return 2
    args = _main_parser().parse_args(argv)
    overrides = list(args.overrides)
    if args.run_dir:
        overrides.append(f"run.dir={args.run_dir}")
    if args.steps is not None:
        overrides.append(f"run.steps={args.steps}")
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        console.print(f"[red]error:[/red] {e}")
        return 2

    from trainer_jax.mismatch_probe import run_probe  # heavy imports after argument checks

    console.print(f"[bold]mixrl[/bold] {cfg.run.name}: {len(cfg.groups)} sampler groups, "
                  f"run dir {cfg.run.dir}")
    report = run_probe(cfg, cfg.run.dir)
    table = Table(title="sampler groups vs fp32 trainer (per-token KL(b||p) estimates)")
    for col in ("group", "dtype", "attention", "tokens", "k1 mean", "k3 mean", "max |log r|", "tok/s"):
        table.add_column(col)
    for name, g in report["groups"].items():
        table.add_row(name, g["dtype"], g["attention"], str(g["tokens"]), f"{g['k1_mean']:.2e}",
                      f"{g['k3_mean']:.2e}", f"{g['max_abs_log_ratio']:.2e}", f"{g['tokens_per_s']:.0f}")
    console.print(table)
    console.print(f"weights: {report['weights']}  report: {cfg.run.dir}/probe.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
