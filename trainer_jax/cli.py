"""`mixrl-train`: the trainer's command line.

    mixrl-train --config configs/local_mixed.yaml [key=value ...]   run the configured job
    mixrl-train serve [--config C] [--listen HOST:PORT] [key=value ...]   the rollout service alone
    mixrl-train sft|plot|sweep ...                                  (brought by later issues)
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.table import Table

from trainer_jax.config import ConfigError, load_config

# Subcommands the design names whose implementation lands with later work.
PLANNED = {
    "sft": "the supervised warm start (training-loop issue)",
    "plot": "run plots (training-loop issue)",
    "sweep": "the ablation sweep (reproduction issue)",
}


def _main_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mixrl-train",
        description="Train a policy from mixed-precision sampler groups. Without a subcommand, runs "
                    "the job the config describes. Subcommands: serve, " + ", ".join(PLANNED) + ".")
    p.add_argument("--config", required=True, help="YAML run config (see configs/)")
    p.add_argument("--run-dir", help="output directory (overrides run.dir)")
    p.add_argument("--steps", type=int, help="number of steps (overrides run.steps)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. run.seed=3")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    console = Console()
    if argv and argv[0] == "serve":
        return serve_main(argv[1:])
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


# ------------------------------------------------------------------------------------------------
# `mixrl-train serve`: the rollout service alone (tasks from the config, trajectories validated,
# counted and dropped, weights from a directory) -- to check that a sampler fleet can connect.


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mixrl-train serve",
        description="Run only the gRPC rollout service: tasks from the config, trajectories validated, "
                    "counted and dropped, weights published from --weights-dir. The bearer token comes "
                    "from --token-file or $MIXRL_TOKEN.")
    p.add_argument("--config", help="YAML run config (its service: and tasks: sections); defaults if absent")
    p.add_argument("--listen", help="HOST:PORT to bind (overrides service.listen; port 0 picks one)")
    p.add_argument("--token-file", help="bearer token file (overrides service.token_file)")
    p.add_argument("--weights-dir", help="weights published as version 0 (overrides service.weights_dir)")
    p.add_argument("--status-every", type=float, default=10.0, help="seconds between status lines (0: off)")
    p.add_argument("--summary-json", help="write the final status here on exit")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. tasks.count=100")
    return p


def serve_main(argv: list[str]) -> int:
    import json
    import logging
    import signal
    import threading

    args = _serve_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    overrides = list(args.overrides)
    for key, value in (("service.listen", args.listen), ("service.token_file", args.token_file),
                       ("service.weights_dir", args.weights_dir)):
        if value is not None:
            overrides.append(f"{key}={value}")
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"mixrl-train serve: {e}", file=sys.stderr)
        return 2

    from trainer_jax.service import RolloutService
    from trainer_jax.service.auth import TokenError, resolve_token
    from trainer_jax.service.server import watch_status_lines, weight_dirs

    try:
        token = resolve_token(cfg.service.token_file)
        service = RolloutService.from_config(cfg, token=token)
        dirs = (weight_dirs(cfg.service.weights_dir, cfg.service.weights_format)
                if cfg.service.weights_dir else None)
    except (TokenError, ValueError, FileNotFoundError) as e:
        print(f"mixrl-train serve: {e}", file=sys.stderr)
        return 2
    try:
        service.start()
    except OSError as e:
        print(f"mixrl-train serve: {e}", file=sys.stderr)
        return 1
    if dirs:
        service.publish_version(0, dirs)
    service.start_drain()
    print(f"mixrl-train serve: listening on {service.address}", flush=True)

    done = threading.Event()

    def on_signal(signum, frame):
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if args.status_every > 0:
        def report():
            for line in watch_status_lines(service, args.status_every):
                print(line, flush=True)
        threading.Thread(target=report, daemon=True).start()
    done.wait()
    service.stop(grace=1.0)
    status = service.status()
    if args.summary_json:
        from pathlib import Path

        Path(args.summary_json).write_text(json.dumps(status, indent=2, default=str) + "\n")
    totals = status["totals"]
    print(f"mixrl-train serve: stopped; accepted {totals.get('accepted', 0)}, rejected "
          f"{totals.get('rejected', 0)}, groups dropped {status['dropped_groups']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
