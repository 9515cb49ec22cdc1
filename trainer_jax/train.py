"""`mixrl-train`: the fully asynchronous loop.

The trainer process runs the rollout service (gRPC, in threads) and the learner (main thread);
local sampler groups run as ``mixrl-sample`` subprocesses (``trainer_jax.samplers``), each with its
own precision recipe. Each step runs the loop's stages (``trainer_jax.loop``) in order: take the
first P complete prompt groups from the buffer, whichever sampler produced them and whatever
weights version they were generated with (no staleness cap unless ``train.max_staleness``); build
the batch (group-relative advantages, packing); learn (the corrected objective, an optax step);
every ``publish_every`` steps publish the new weights in every format a group loads, in the
background (``trainer_jax.publisher``), so the next step never waits for a publish and samplers
reload in flight; evaluate through the fleet (``trainer_jax.evaluation``); record the step's
metrics. ``train.sync`` swaps the take/publish policy (``trainer_jax.loop.modes``), nothing else.
Checkpoints (orbax) hold the learner and the loop state; ``--resume`` continues from the last one
with fresh tasks (the task cursor is part of the checkpoint). This process imports neither torch
nor the sampler package.

With several JAX processes (``distributed:``), process 0 runs all of the above and announces each
collective (step, publish, calibrate, probe, checkpoint, stop) to the others
(``trainer_jax.parallel.lockstep``), which run the same collectives on the inputs it broadcasts
and talk to nothing else (``trainer_jax.loop.collectives``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh
from rich.console import Console

from convert.tokenizer import char_tokenizer, load_tokenizer, save_tokenizer_files, special_token_ids
from trainer_jax.checkpoint import Checkpointer
from trainer_jax.config import ConfigError, RunConfig
from trainer_jax.console_log import console_logging
from trainer_jax.cost import TrainerCost, ledger_from_checkpoint
from trainer_jax.diagnostics import MetricsSink, plot_run
from trainer_jax.episode_log import EpisodeLog
from trainer_jax.faults import fault_point
from trainer_jax.learner import Learner
from trainer_jax.loop.batches import BatchBuilder, save_trajectories
from trainer_jax.loop.collectives import Collectives
from trainer_jax.loop.evaluate import Evaluation
from trainer_jax.loop.modes import loop_mode
from trainer_jax.loop.publish import Publishing, weight_formats
from trainer_jax.loop.record import Recorder
from trainer_jax.parallel.lockstep import Lockstep
from trainer_jax.parallel.mesh import describe, make_mesh
from trainer_jax.parallel.rules import ShardingRules
from trainer_jax.policy import build_policy, check_layout
from trainer_jax.progress import Phase, StepProgress
from trainer_jax.resume import continue_versions, set_aside_previous_run, trim_metrics
from trainer_jax.samplers import LocalSamplers
from trainer_jax.service.auth import TokenError, read_token_file, run_token, write_token_file
from trainer_jax.service.probe_report import probe_summary
from trainer_jax.service.server import RolloutService
from trainer_jax.service.tasks import build_task_source
from trainer_jax.sft import warm_start
from trainer_jax.waits import announce_registrations, take


class Trainer:
    """One ``mixrl-train`` process: sets up the learner and, on process 0, the stages of the loop
    (``trainer_jax.loop``), then runs them (``run``); the other processes follow process 0."""

    def __init__(self, cfg: RunConfig, *, resume: bool = False, console: Console | None = None,
                 lockstep: Lockstep | None = None, mesh: Mesh | None = None, tokenizer=None):
        self.cfg = cfg
        self.mesh = mesh if mesh is not None else make_mesh(cfg.mesh)
        self.console = console or Console(soft_wrap=True)  # one line per message, as cli.py's
        self.lockstep = lockstep or Lockstep()
        self.leader = self.lockstep.leader  # process 0: the service, samplers, files, metrics
        self.run_dir = Path(cfg.run.dir).absolute()
        self.tokenizer = tokenizer  # None: loaded in _setup
        if self.leader:
            # Read before the set-aside: a token file inside the run directory keeps its token.
            self.token_file, self.token = self._token(resume)
            if not resume and (aside := set_aside_previous_run(self.run_dir)) is not None:
                self.console.print(f"an earlier run in {self.run_dir} was moved to {aside} "
                                   "(--resume continues a run instead)")
            self.run_dir.mkdir(parents=True, exist_ok=True)
            # service.token_file: an existing file wins (samplers may already hold its token) and
            # is only read: it may sit on a read-only mount (a secret volume).
            if not (cfg.service.token_file and self.token_file.is_file()):
                self.token = write_token_file(self.token_file, self.token,
                                              replace=not cfg.service.token_file)
        self.resume = resume
        self.group_names = [g.name for g in cfg.groups]
        self.samplers = LocalSamplers(cfg, self.run_dir)

    # ------------------------------------------------------------------ setup

    def _token(self, resume: bool) -> tuple[Path, str]:
        try:
            return run_token(self.cfg.service.token_file, self.run_dir, resume)
        except TokenError as e:
            raise ConfigError(f"service.token_file: {e}") from None

    def _setup(self) -> None:
        """The learner and its checkpoints (every process); process 0's run files and tasks."""
        self._setup_learner()
        # The warm start's demonstrations come from the evaluation source (every process).
        self.eval_source = build_task_source(self.cfg.tasks, tokenizer=self.tokenizer,
                                             seed=self.cfg.train.eval_seed, prefix="eval", evaluation=True)
        self.sink = None
        if self.leader:
            self._setup_run()

    def _setup_learner(self) -> None:
        cfg, run = self.cfg, self.run_dir
        if self.lockstep.multi:  # the others open the run directory once process 0 has set it up
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("mixrl-train: run directory ready")
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(cfg.model.hf_dir) if cfg.model.hf_dir else char_tokenizer()
        self.tokenizer_dir = run / "tokenizer"
        if self.leader:
            save_tokenizer_files(self.tokenizer, self.tokenizer_dir)  # the source's files, unchanged
        self.model, self.qcfg = build_policy(cfg, self.tokenizer.get_vocab_size(),
                                             special_token_ids(self.tokenizer), self.mesh)
        objective = cfg.objective.model_copy(update={"num_groups": max(1, len(cfg.groups))})
        self.learner = Learner(self.model, cfg.optimizer, objective, self.mesh,
                               ShardingRules.for_model(self.qcfg, cfg.mesh.rules),
                               micro_rows=cfg.train.micro_rows,
                               context_attention=cfg.mesh.context_attention)
        self.console.print(f"learner on mesh {describe(self.mesh)} ({self.mesh.size} devices, "
                           f"{jax.devices()[0].platform}, process {self.lockstep.index} of "
                           f"{self.lockstep.count})")
        from trainer_jax.kernels.checked import describe_choice  # what auto picked, and why

        for kind, configured in (("attention", cfg.model.attention),
                                 ("linear_logsumexp", cfg.objective.impl)):
            self.console.print(describe_choice(kind, configured))
        self.checkpointer = Checkpointer(
            run / "checkpoints", keep_last=cfg.train.keep_checkpoints,
            log=lambda line: self.console.print(f"[yellow]{line}[/yellow]"))
        self.meta = {"step": 0, "version": 0, "task_cursor": 0, "sft_done": False, "history": {}}
        self.restored = False
        if self.resume and self.checkpointer.latest_step() is not None:
            self.meta = self.checkpointer.restore(self.model, self.learner.optimizer)
            self.restored = True
            step, version = self.meta["step"], self.meta["version"]
            self.console.print(f"resumed from step {step} (checkpoint {self.checkpointer.step_dir(step)}, "
                               f"weights v{version})")
        self.collectives = Collectives(cfg, self.lockstep, self.learner, self.checkpointer, self.meta)

    def _setup_run(self) -> None:
        """Process 0: the metrics sink, the cost ledger, the task source and the loop's mode."""
        cfg, run = self.cfg, self.run_dir
        if self.resume:  # steps after the checkpoint are trained again: their records go aside
            if moved := trim_metrics(run, self.meta["step"] if self.restored else None):
                self.console.print(f"{moved} metric records after the restored step moved to "
                                   "metrics.discarded.jsonl")
        self.sink = MetricsSink(run, wandb=cfg.logging.wandb.model_dump() if cfg.logging.wandb else None)
        # Replica-hours, USD and useful samples per group (trainer_jax.cost); the ledger's totals
        # are checkpointed with the meta, so a resumed run continues the restored step's totals.
        prices, accelerators = cfg.group_prices(), {g.name: g.accelerator for g in cfg.groups}
        ledger, warning = ledger_from_checkpoint(prices, accelerators, self.meta if self.restored else None)
        if warning:
            self.console.print(f"[yellow]warning:[/yellow] {warning}", highlight=False)
        self.cost = TrainerCost(prices, accelerators, ledger=ledger)
        self.source = build_task_source(cfg.tasks, tokenizer=self.tokenizer)
        self.source.cursor = int(self.meta["task_cursor"])
        self.mode = loop_mode(cfg, self.source)  # train.sync: the take/publish policy
        self.batches = BatchBuilder(cfg, carry=self.mode.carry)

    def _warm_start(self) -> None:
        cfg = self.cfg
        if cfg.sft.steps == 0 or self.meta["sft_done"]:
            return
        with Phase(self.console, "supervised warm start", total=cfg.sft.steps) as phase:
            def on_step(step, loss):
                phase.update(step + 1, f"loss {loss:.3f}")
                if self.sink is not None and (step % 10 == 0 or step == cfg.sft.steps - 1):
                    self.sink.write(step - cfg.sft.steps, {"sft/loss": loss})

            # Every process draws the same demonstrations; process 0's are the ones trained on.
            losses = warm_start(self.model, self.eval_source.envs, cfg.sft,
                                np.random.default_rng(cfg.run.seed), on_step=on_step,
                                share=self.lockstep.share, context=self.learner.context)
        self.meta["sft_done"] = True
        self.console.print(f"warm start: {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")

    def _start_stages(self) -> None:
        """Process 0: the rollout service and the stages that talk to it."""
        cfg, multi = self.cfg, self.lockstep.multi
        self.service = RolloutService.from_config(cfg, token=self.token, source=self.mode.source).start()
        self.console.print(f"rollout service on {self.service.address} (bearer token in {self.token_file})")
        announce_registrations(self.service, cfg, self._line)
        self.evaluation = Evaluation(cfg, self.eval_source, self.service, self.console)
        self.publishing = Publishing(
            cfg, self.model, self.qcfg, self.source, self.service, snapshot=self.collectives.snapshot,
            run_dir=self.run_dir, tokenizer_dir=self.tokenizer_dir,
            calibration_ids=self.collectives.calibration_ids if multi else None,
            probe_inputs=self.collectives.probe_inputs if multi else None)
        self.recorder = Recorder(cfg, sink=self.sink, cost=self.cost, service=self.service,
                                 samplers=self.samplers, source=self.source, batches=self.batches,
                                 episode_log=EpisodeLog(self.run_dir, cfg.train.log_episodes, self.tokenizer))

    def _start_samplers(self, paths: dict[str, Path]) -> None:
        self.samplers.start(self.service.address, self.token_file, paths)
        self.console.print(f"started {len(self.samplers.processes)} sampler processes "
                           f"({self.samplers.describe()})")
        registered = lambda: len(self.service.status()["samplers"])  # noqa: E731
        with Phase(self.console, "samplers registering",
                   status=lambda: f"{registered()} of {len(self.samplers.processes)} registered"):
            self.samplers.wait_registered(registered, self.cfg.train.sampler_start_timeout_s)

    def _first_version(self) -> int:
        """The version the run publishes first: on ``--resume`` past every version ever published
        here, so no sampler takes the new weights for old ones; versions after the checkpoint are
        set aside (``trainer_jax.resume``)."""
        version = int(self.meta["version"])
        if self.resume:
            version, discarded = continue_versions(self.run_dir / "weights",
                                                   version if self.restored else None)
            if discarded:
                self.console.print(f"weights v{discarded[0]}..v{discarded[-1]} were published after the "
                                   "restored checkpoint: moved to weights/discarded/")
        return version

    # ------------------------------------------------------------------ the run

    def run(self) -> dict:
        with Phase(self.console, "setting up (model, tasks, tokenizer)"):
            self._setup()
        self._warm_start()
        if not self.leader:
            self.console.print(f"process {self.lockstep.index}: following process 0's orders")
            steps = self.collectives.follow()
            return {"run_dir": str(self.run_dir), "process": self.lockstep.index, "steps": steps}
        self._start_stages()
        self.meta["version"] = version = self._first_version()
        summary = {"run_dir": str(self.run_dir), "formats": weight_formats(self.cfg, self.service),
                   "mesh": {a: int(self.mesh.shape[a]) for a in self.mesh.axis_names},
                   "devices": int(self.mesh.size), "processes": self.lockstep.count}
        history = self.meta["history"]
        failed, started = True, False
        try:
            with Phase(self.console, f"publishing weights v{version}"):
                paths = self.mode.first(version, self.publishing)
            started = True  # from here on a stop leaves a checkpoint
            self._start_samplers(paths)
            if not self.resume or "eval_start" not in history:
                history["eval_start"] = self.evaluation("start", self.publishing.latest)
                self.sink.write(self.meta["step"], history["eval_start"])
            self._loop()
            self.publishing.close()  # the last requested version is on disk before the final eval
            self.console.print(self.publishing.bytes_summary())
            history["eval_end"] = self.evaluation("end", self.publishing.latest)
            self.sink.write(self.meta["step"], history["eval_end"])
            failed = False
        finally:
            self.samplers.stop()
            self.publishing.close()
            self.service.stop()
            try:
                if started:
                    self._save_checkpoint()
            finally:
                self.collectives.stop(failed)
                self.sink.close()
                self.checkpointer.close()
        return self._write_summary(summary)

    def _write_summary(self, summary: dict) -> dict:
        """``summary.json``: the run's shape, evaluations, publications, probe and cost totals."""
        history, plots = self.meta["history"], plot_run(self.run_dir)
        summary.update(steps=self.meta["step"], eval_start=history.get("eval_start", {}),
                       eval_end=history.get("eval_end", {}), publish_errors=self.publishing.errors,
                       weights=self.publishing.bytes_summary(),
                       probe=probe_summary(self.service.status(), self.service.probes),
                       cost=self.cost.ledger.summary(),
                       plots=[str(p) for p in plots])
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    def _loop(self) -> None:
        """Take groups -> build the batch -> learn -> publish -> evaluate -> record, per step."""
        cfg, meta = self.cfg, self.meta
        self.cost.start()  # the first step is charged from here (the ledger is built in _setup)
        with StepProgress(self.console, cfg.run.steps, meta["step"], cfg.train.log_every) as progress:
            while meta["step"] < cfg.run.steps:
                t0 = time.perf_counter()
                groups = self.mode.take(self._take, meta["version"])
                t1 = time.perf_counter()
                batch = self.batches.build(groups, meta["version"])
                self.publishing.observe(batch.trained_sequences())  # the next calibration's data
                save_trajectories(self.run_dir, batch, step=meta["step"] + 1, version=meta["version"],
                                  group_names=self.group_names)
                fault_point("learner_step")
                result = self.collectives.step(batch.inputs, batch.tokens)
                t2 = time.perf_counter()
                meta["step"] += 1
                step = meta["step"]
                values = self.recorder.measure(step, meta["version"], groups, batch, result, t1 - t0, t2 - t1)
                if step % cfg.train.publish_every == 0:  # every step in synchronous mode
                    meta["version"] += 1
                    self.mode.publish(meta["version"], self.publishing)
                values.update(self.mode.metrics())
                self.publishing.check()
                if self.evaluation.due(step):
                    values.update(self.evaluation(f"step {step}", self.publishing.latest))
                self.recorder.record(step, values, batch, progress)
                if step % cfg.train.checkpoint_every == 0:
                    self._save_checkpoint()
                progress.advance(self.recorder.summary(values, result))

    def _save_checkpoint(self) -> None:
        """Process 0: checkpoint the step with the task cursor and the cost ledger's totals."""
        self.collectives.checkpoint(task_cursor=int(self.source.cursor), cost=self.cost.ledger.state())

    def _line(self, line: str) -> None:
        self.console.print(line, markup=False, highlight=False)

    def _take(self, n: int):
        return take(self.service, self.samplers, self.cfg, n, print_line=self._line)


def train(cfg: RunConfig, *, resume: bool = False, console: Console | None = None) -> dict:
    from trainer_jax.batch_shape import check_tasks
    from trainer_jax.parallel.distributed import init_distributed

    console = console or Console(soft_wrap=True)
    console_logging(console)  # library warnings as console lines, not `WARNING:name:` records
    # Before jax.distributed, a checkpoint or the run directory: the tasks with the run's tokenizer
    # (an environment it cannot serve, a dataset's longest prompt against the batch shape) and a
    # token file that cannot be read; each one line (ConfigError).
    tokenizer = load_tokenizer(cfg.model.hf_dir) if cfg.model.hf_dir else char_tokenizer()
    if warning := check_tasks(cfg, tokenizer):
        console.print(f"[yellow]warning:[/yellow] {warning}", highlight=False)
    try:
        if cfg.service.token_file:
            read_token_file(cfg.service.token_file)
    except TokenError as e:
        raise ConfigError(f"service.token_file: {e}") from None
    init_distributed(cfg.distributed)  # before anything touches a device
    mesh = make_mesh(cfg.mesh)
    check_layout(cfg, mesh)  # before the run directory is touched
    lockstep = Lockstep(cfg.distributed.heartbeat_timeout_s)
    trainer = Trainer(cfg, resume=resume, console=console, lockstep=lockstep, mesh=mesh, tokenizer=tokenizer)
    if lockstep.watch is not None and lockstep.leader:  # a lost peer: take the samplers down too
        lockstep.watch.on_lost.append(lambda _line: trainer.samplers.stop(grace_s=2.0))
    return trainer.run()


__all__ = ["Trainer", "build_policy", "set_aside_previous_run", "train"]
