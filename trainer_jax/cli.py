"""`mixrl-train`: the trainer's command line.

    mixrl-train --config configs/local_mixed.yaml [--resume] [key=value ...]   train
    mixrl-train serve [--config C] [--listen HOST:PORT] [key=value ...]   the rollout service alone
    mixrl-train sft --config C --out HF_DIR [key=value ...]   the supervised warm start alone

``mixrl-train plot``, ``sweep`` and ``plan`` are the experiment tools' (``experiments/cli.py``, the
console script, which hands every other command line to ``main`` here unchanged); ``python -m
trainer_jax.cli`` runs the trainer's alone.

Overrides: ``key.sub=value`` (a YAML value) for any config key; ``'groups[NAME].key=value'``
for the group named NAME (``groups[bf16].capacity=32``, ``groups[h100-fp8].spawn=false``).
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys

from rich.console import Console
from rich.table import Table

from trainer_jax.config import ConfigError, load_config

# Subcommands the design names whose implementation lands with later work.
PLANNED: dict[str, str] = {}


def _main_parser() -> argparse.ArgumentParser:
    # plot, sweep and plan are experiments.cli's, listed here because `mixrl-train --help` is this text.
    p = argparse.ArgumentParser(
        prog="mixrl-train",
        description="Train a policy from mixed-precision sampler groups. Without a subcommand, runs "
                    "the job the config describes. Subcommands: serve, sft, plot, sweep, plan"
                    + "".join(f", {k}" for k in PLANNED) + ".")
    p.add_argument("--config", required=True, help="YAML run config (see configs/)")
    p.add_argument("--run-dir", help="output directory (overrides run.dir)")
    p.add_argument("--steps", type=int, help="number of steps (overrides run.steps)")
    p.add_argument("--resume", action="store_true", help="continue from the run dir's last checkpoint")
    p.add_argument("--prices", metavar="FILE", help="price table (YAML/JSON: accelerator: USD per "
                   "replica-hour) merged over the config's prices:")
    p.add_argument("--plan", metavar="FILE", help="a plan.yaml of mixrl-train plan: its groups' replica "
                   "counts, accelerators and prices over the config's (a group given 0 leaves the pool)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides as YAML values, e.g. run.seed=3; a group by name: "
                        "'groups[bf16].capacity=32', 'groups[h100-fp8].spawn=false' (quote them: "
                        "the shell reads [..] as a pattern)")
    return p


def _one_line(e: BaseException) -> str:
    """An error as one line of rich markup showing its text as is (``groups[bf16]`` would
    otherwise be read as a style tag and vanish)."""
    from rich.markup import escape

    return escape(" ".join(str(e).split()))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # soft_wrap: every message stays one line however long its paths (off a terminal rich would
    # wrap at 80 columns); tables still lay out to the width.
    console = Console(soft_wrap=True)
    if argv and argv[0] == "serve":
        return serve_main(argv[1:])
    if argv and argv[0] == "sft":
        return sft_main(argv[1:])
    if argv and argv[0] in PLANNED:
        sub = argparse.ArgumentParser(prog=f"mixrl-train {argv[0]}", description=PLANNED[argv[0]])
        sub.parse_known_args(argv[1:])  # --help works; anything else is not built yet
        console.print(f"[red]mixrl-train {argv[0]}: not implemented yet[/red] ({PLANNED[argv[0]]})")
        return 2
    args = _main_parser().parse_intermixed_args(argv)  # key=value before or after the flags
    overrides = list(args.overrides)
    if args.plan:  # the plan's groups first: key=value overrides still apply over them
        from trainer_jax.plan_file import PlanError, plan_overrides

        try:
            overrides = plan_overrides(args.config, args.plan) + overrides
        except PlanError as e:
            Console(stderr=True, soft_wrap=True).print(f"[red]error:[/red] {_one_line(e)}", highlight=False)
            return 2
    if args.run_dir:
        overrides.append(f"run.dir={args.run_dir}")
    if args.steps is not None:
        overrides.append(f"run.steps={args.steps}")
    # Bad input is one line on stderr and exit 2, before the model is built or the previous run
    # is moved aside (the config, the files it names, then the machine's devices in train()).
    errors = Console(stderr=True, soft_wrap=True)
    try:
        cfg = load_config(args.config, overrides, prices=args.prices)
        from trainer_jax.batch_shape import check_config
        from trainer_jax.config.checks import check_host_devices, check_model_files

        check_model_files(cfg)  # the model directory's tokenizer and the chat template tasks need
        check_host_devices(cfg)  # spawned groups' cuda:N against this host's GPUs
        check_config(cfg)  # a batch shape that drops samples, before JAX is imported
    except ConfigError as e:
        errors.print(f"[red]error:[/red] {_one_line(e)}", highlight=False)
        return 2

    from trainer_jax.train import train  # heavy imports after argument checks

    # `kill -USR1 <pid>` prints every thread's Python stack to stderr: what a stuck run waits on.
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    console.print(f"[bold]mixrl[/bold] {cfg.run.name}: {len(cfg.groups)} sampler groups "
                  f"({', '.join(f'{g.name}:{g.recipe}' for g in cfg.groups)}), run dir {cfg.run.dir}")
    from trainer_jax.checkpoint import CheckpointError
    from trainer_jax.resume import StorageError

    try:
        summary = train(cfg, resume=args.resume, console=console)
    except ConfigError as e:  # the config against the machine (mesh, platform): found at setup
        errors.print(f"[red]error:[/red] {_one_line(e)}", highlight=False)
        return 2
    except (CheckpointError, StorageError, OSError) as e:  # disk full, unwritable, corrupt: one line
        console.print(f"[red]error:[/red] {_one_line(e)}")
        # Exit now: the run has closed what it owns, and library exit hooks (tensorboard's flush,
        # orbax's event loops) would fail again on the same disk and bury the line in tracebacks.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if "eval_start" not in summary:  # a process other than 0 of a multi-process run
        console.print(f"process {summary['process']}: trained {summary['steps']} steps with process 0")
        return 0
    keys = sorted(set(summary["eval_start"]) | set(summary["eval_end"]))
    if keys:
        table = Table(title=f"{cfg.run.name}: {summary['steps']} steps")
        table.add_column("")
        for key in keys:
            table.add_column(key)
        for label in ("eval_start", "eval_end"):
            row = summary[label]
            table.add_row(label.replace("eval_", ""), *(f"{row.get(k, float('nan')):.3f}" for k in keys))
        console.print(table)
    else:  # an empty table printed two bare row labels
        console.print(f"{cfg.run.name}: {summary['steps']} steps (no held-out evaluation: "
                      "train.eval_tasks or train.eval_every is 0)")
    for err in summary["publish_errors"]:
        console.print(f"[red]publish failed[/red] {err}")
    console.print(f"run dir: {summary['run_dir']} (summary.json, metrics.jsonl, tensorboard/, plots/, "
                  "checkpoints/, weights/, logs/)")
    return 0


def sft_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="mixrl-train sft",
        description="Supervised warm start on the config's task mix; writes an HF directory usable as "
                    "model.hf_dir.")
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True, help="HF directory to write (must not exist)")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_intermixed_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        from trainer_jax.config.checks import check_model_files

        check_model_files(cfg)  # the model directory's tokenizer and template, before training
    except ConfigError as e:
        print(f"mixrl-train sft: {e}", file=sys.stderr)
        return 2
    if os.path.lexists(args.out):  # before the training, not after it
        print(f"mixrl-train sft: --out {args.out} already exists; name a new directory", file=sys.stderr)
        return 2
    import numpy as np

    from convert.tokenizer import char_tokenizer, load_tokenizer, special_token_ids
    from trainer_jax.models import save_hf
    from trainer_jax.policy import build_policy
    from trainer_jax.service.tasks import build_task_source
    from trainer_jax.sft import warm_start

    tokenizer = load_tokenizer(cfg.model.hf_dir) if cfg.model.hf_dir else char_tokenizer()
    model, qcfg = build_policy(cfg, tokenizer.get_vocab_size(), special_token_ids(tokenizer))
    envs = build_task_source(cfg.tasks, tokenizer=tokenizer).envs
    losses = warm_start(model, envs, cfg.sft, np.random.default_rng(cfg.run.seed))
    import tempfile

    with tempfile.TemporaryDirectory() as tok_dir:
        tokenizer.save(f"{tok_dir}/tokenizer.json")
        save_hf(model, qcfg, args.out, tokenizer_dir=tok_dir)
    print(f"mixrl-train sft: {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}; wrote {args.out}")
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
        if cfg.service.router.policy == "cost":  # its useful shares come from a learner's steps
            raise ConfigError("service.router.policy cost needs a learner to feed it each group's "
                              "useful share; mixrl-train serve has none (use throughput)")
    except ConfigError as e:
        print(f"mixrl-train serve: {e}", file=sys.stderr)
        return 2

    from trainer_jax.service import RolloutService
    from trainer_jax.service.auth import TokenError, resolve_token
    from trainer_jax.service.server import weight_dirs
    from trainer_jax.service.status import watch_status_lines

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
