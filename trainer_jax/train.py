"""`mixrl-train`: the fully asynchronous loop.

The trainer process runs the rollout service (gRPC, in threads) and the learner (main thread);
local sampler groups run as ``mixrl-sample`` subprocesses (``trainer_jax.samplers``), each with its
own precision recipe. Each step takes the first P complete prompt groups from the buffer,
whichever sampler produced them and whatever weights version they were generated with (no
staleness cap unless ``train.max_staleness``), computes group-relative advantages and the
corrected objective, and takes an optax step. Every ``publish_every`` steps the new weights are
exported in every format a group loads by a background publisher (``trainer_jax.publisher``), so
the next step never waits for a publish; samplers reload in flight. Evaluation runs through the
fleet (``trainer_jax.evaluation``). Checkpoints (orbax) hold the learner and the loop state;
``--resume`` continues from the last one with fresh tasks (the task cursor is part of the
checkpoint). This process imports neither torch nor the sampler package.

With several JAX processes (``distributed:``), process 0 runs all of the above and announces each
collective (step, publish, checkpoint, stop) to the others (``trainer_jax.parallel.lockstep``),
which run the same collectives on the batch it broadcasts and talk to nothing else.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from rich.console import Console

from convert.tokenizer import char_tokenizer, load_tokenizer, save_tokenizer_files, special_token_ids
from mixrl_wire.recipes import BACKENDS
from trainer_jax.batching import Sample, pack
from trainer_jax.checkpoint import Checkpointer
from trainer_jax.config import ConfigError, RunConfig
from trainer_jax.console_log import console_logging
from trainer_jax.cost import TrainerCost, ledger_from_checkpoint, status_text
from trainer_jax.diagnostics import AdvantageAlarm, CollapseAlarms, MetricsSink, alarm_settle_steps, plot_run
from trainer_jax.episode_log import EpisodeLog, episode_metrics
from trainer_jax.evaluation import FleetEvaluator
from trainer_jax.faults import during, fault_point
from trainer_jax.follower import follow
from trainer_jax.learner import Learner
from trainer_jax.objective import compute_advantages, reduce_metrics
from trainer_jax.parallel.lockstep import (
    CALIBRATE,
    CHECKPOINT,
    PROBE,
    PUBLISH,
    STEP,
    STOP,
    Lockstep,
    Order,
)
from trainer_jax.parallel.mesh import describe, make_mesh
from trainer_jax.parallel.rules import ShardingRules
from trainer_jax.policy import build_policy, check_layout
from trainer_jax.progress import Phase, StepProgress
from trainer_jax.publisher import snapshot
from trainer_jax.publishing import start_publisher
from trainer_jax.resume import (
    StorageError,
    continue_versions,
    set_aside_previous_run,
    storage_failure,
    trim_metrics,
)
from trainer_jax.samplers import LocalSamplers
from trainer_jax.service.auth import TokenError, read_token_file, run_token, write_token_file
from trainer_jax.service.probe_report import lag_alarms, probe_line, probe_metrics, probe_summary
from trainer_jax.service.server import RolloutService
from trainer_jax.service.tasks import build_task_source
from trainer_jax.sft import warm_start
from trainer_jax.sync import SyncTasks
from trainer_jax.waits import announce_registrations, take


class Trainer:
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
        self.carry: list[tuple[Sample, float]] = []
        self.carry_dropped = 0
        self.too_long = 0

    # ------------------------------------------------------------------ setup

    def _token(self, resume: bool) -> tuple[Path, str]:
        try:
            return run_token(self.cfg.service.token_file, self.run_dir, resume)
        except TokenError as e:
            raise ConfigError(f"service.token_file: {e}") from None

    def _setup(self) -> None:
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
        # The warm start's demonstrations come from the evaluation source (every process).
        self.eval_source = build_task_source(cfg.tasks, tokenizer=self.tokenizer, seed=cfg.train.eval_seed,
                                             prefix="eval", evaluation=True)
        if not self.leader:
            self.sink = None
            return
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
        self.alarms = CollapseAlarms(settle_steps=alarm_settle_steps(cfg.optimizer.warmup_steps))
        self.advantage_alarm = AdvantageAlarm()  # groups whose float32 advantages are not finite
        self._probe_alarms_seen = 0  # probe reports above their bound already printed
        self.source = build_task_source(cfg.tasks, tokenizer=self.tokenizer)
        self.source.cursor = int(self.meta["task_cursor"])
        self.episode_log = EpisodeLog(run, cfg.train.log_episodes, self.tokenizer)
        # train.sync: the service sees the source through a version gate (trainer_jax.sync).
        self.sync = SyncTasks(self.source, cfg.train.prompts_per_step) if cfg.train.sync else None

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

    def _start_service(self) -> None:
        source = self.sync or self.source
        self.service = RolloutService.from_config(self.cfg, token=self.token, source=source).start()
        self.evaluator = FleetEvaluator(self.cfg, self.eval_source, self.service)
        self.console.print(f"rollout service on {self.service.address} (bearer token in {self.token_file})")
        announce_registrations(self.service, self.cfg, self._line)

    def _start_samplers(self, paths: dict[str, Path]) -> None:
        self.samplers.start(self.service.address, self.token_file, paths)
        self.console.print(f"started {len(self.samplers.processes)} sampler processes "
                           f"({self.samplers.describe()})")
        registered = lambda: len(self.service.status()["samplers"])  # noqa: E731
        with Phase(self.console, "samplers registering",
                   status=lambda: f"{registered()} of {len(self.samplers.processes)} registered"):
            self.samplers.wait_registered(registered, self.cfg.train.sampler_start_timeout_s)

    def weight_formats(self) -> list[str]:
        """The config's formats, plus the preferred one of each sampler that loads none of them."""
        formats = self.cfg.weight_formats()
        return formats + [f for f in self.service.scheduler.unserved_formats(formats) if f not in formats]

    def export_engines(self) -> str:
        """``mixrl`` while every sampler is the mixrl engine (it loads any shape), else ``serving``:
        projections a serving engine's kernels cannot take stay bf16 (``convert.export``). Tiny
        local models then keep their fp8 groups in fp8; a SGLang/vLLM group that joins switches
        the next version to serving layouts."""
        if any(not g.spawn for g in self.cfg.groups):
            return "serving"
        backends = {s["recipe"].get("backend", "") for s in self.service.status()["samplers"]}
        return "mixrl" if backends <= {BACKENDS["engine"], ""} else "serving"

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, label: str) -> dict[str, float]:
        """pass@1 / pass@k of the newest published version, run by the evaluation group."""
        if not self.evaluator.enabled:
            return {}
        try:
            with Phase(self.console, f"eval ({label})"):
                result = self.evaluator.evaluate(self.publisher.published[-1])
        except TimeoutError as e:
            self.console.print(f"[yellow]eval ({label}) skipped[/yellow]: {e}")
            return {}
        k = self.cfg.train.eval_k
        self.console.print(f"eval ({label}): pass@1 {result['eval/pass@1']:.3f}, "
                           f"pass@{k} {result[f'eval/pass@{k}']:.3f}")
        return result

    # ------------------------------------------------------------------ the loop

    def _batch(self, groups) -> tuple:
        cfg = self.cfg
        rewards = np.asarray([[t.reward or 0.0 for t in g.trajectories] for g in groups], np.float32)
        adv = np.asarray(compute_advantages(jnp.asarray(rewards), cfg.train.advantage))
        self._adv_values, self._adv_alarms = self.advantage_alarm.check(groups, adv)
        # Samples that did not fit the previous batch go first (their advantages were computed
        # with their own prompt group); at most one batch of them is carried, the rest dropped.
        samples, sample_adv = [s for s, _ in self.carry], [a for _, a in self.carry]
        index = {name: i for i, name in enumerate(self.group_names)}
        for g, a in zip(groups, adv, strict=True):
            for t, ai in zip(g.trajectories, a, strict=True):
                sample = Sample.from_record(t, g.task.prompt_ids, index.get(t.group, 0))
                if len(sample.token_ids) > cfg.train.row_len:  # cannot be packed: count, skip
                    self.too_long += 1
                    continue
                samples.append(sample)
                sample_adv.append(ai)
        inputs, batch, taken = self._pack(samples, np.asarray(sample_adv, np.float32))
        left = sorted(set(range(len(samples))) - set(taken))
        budget = cfg.train.prompts_per_step * cfg.tasks.group_size
        self.carry = [(samples[i], sample_adv[i]) for i in left][:budget]
        self.carry_dropped += max(0, len(left) - budget)
        return inputs, batch, samples, taken, rewards

    def _pack(self, samples: list[Sample], advantages: np.ndarray) -> tuple:
        cfg = self.cfg
        return pack(samples, advantages, rows=cfg.train.rows, row_len=cfg.train.row_len,
                    max_tokens=cfg.train.max_tokens, head_k=cfg.tasks.sampling.head_k,
                    support_k=cfg.train.support_k, temperature=cfg.tasks.sampling.temperature,
                    trainer_version=self.meta["version"], max_staleness=cfg.train.max_staleness)

    # ------------------------------------------------------------------ collectives (every process)

    def _order(self, command: str, failed: bool = False) -> None:
        self.lockstep.announce(Order(command, int(self.meta["step"]), int(self.meta["version"]), failed))

    def _snapshot(self) -> dict[str, np.ndarray]:
        """The parameters as host arrays for a publish (a gather every process joins)."""
        self._order(PUBLISH)
        with self.lockstep.collective():
            return snapshot(self.model)

    def _train_step(self, inputs, batch):
        self._order(STEP)
        with self.lockstep.collective():
            inputs, batch = self.lockstep.share((inputs, batch))
            return self.learner.step(inputs, batch)

    def _calibration_ids(self, ids: np.ndarray, segment_ids: np.ndarray) -> tuple:
        """The calibration forward is a collective too: announce it and share its ids."""
        self._order(CALIBRATE)
        return self.lockstep.share((ids, segment_ids))

    def _probe_inputs(self, inputs: tuple) -> tuple:
        """The version probe's forwards are collectives too: announce them, share the inputs."""
        self._order(PROBE)
        return self.lockstep.share(inputs)

    def _save_checkpoint(self) -> None:
        if self.leader:
            self.meta["task_cursor"] = int(self.source.cursor)
            self.meta["cost"] = self.cost.ledger.state()  # commits with the step (orbax's rename)
            self._order(CHECKPOINT)
        with self.lockstep.collective():
            self.checkpointer.save(self.meta["step"], self.model, self.learner.optimizer, self.meta)

    def _step_metrics(self, groups, samples, taken, rewards, result, wait_s, step_s) -> dict:
        values: dict[str, float] = {"loss": result.loss, "grad_norm": result.grad_norm,
                                    "reward_mean": float(rewards.mean()),
                                    "pass_rate": float((rewards > 0).mean()),
                                    "samples_trained": len(taken), "samples_carried": len(self.carry),
                                    "samples_dropped_total": self.carry_dropped,
                                    "samples_too_long_total": self.too_long,
                                    "version": self.meta["version"]}
        for name, value in reduce_metrics(result.metrics).items():
            arr = np.asarray(value)
            if name.startswith("group/"):
                metric = name.split("/", 1)[1]
                for i, gname in enumerate(self.group_names):
                    values[f"group/{gname}/{metric}"] = float(arr[i])
            else:
                values[name] = float(arr)
        trajectories = [t for g in groups for t in g.trajectories]
        # finish_reason is "termination;errors" (envs.base.finish_reason): the errors are counted
        # per environment by the task source's metrics (env/<entry>/errors/<reason>).
        reasons = Counter(t.finish_reason.partition(";")[0] for t in trajectories)
        for reason, n in reasons.items():
            values[f"termination/{reason}"] = n / len(trajectories)
        by_group = Counter(t.group for t in trajectories)
        for gname in self.group_names:
            values[f"group/{gname}/sample_share"] = by_group.get(gname, 0) / len(trajectories)
        tokens = sum(int(t.loss_mask.sum()) for t in trajectories)
        total = wait_s + step_s
        values["tokens_per_s"] = tokens / max(total, 1e-9)
        values["trainer_idle_share"] = wait_s / max(total, 1e-9)
        status = self.service.status()
        samplers = [s for s in status["samplers"] if not s["revoked"]]
        if samplers:
            values["sampler_idle_share"] = float(np.mean(
                [1 - min(1.0, s["active_samples"] / max(1, s["capacity"])) for s in samplers]))
        for gname, g in status["groups"].items():
            values[f"group/{gname}/tokens_per_s"] = float(g["tokens_per_s"])
        values.update(probe_metrics(status, self.service.probes))
        return values

    def _on_published(self, version: int, paths: dict[str, Path]) -> None:
        self.service.publish_version(version, {k: str(v) for k, v in paths.items()},
                                     probe=self.publisher.probes.get(version))

    def run(self) -> dict:
        with Phase(self.console, "setting up (model, tasks, tokenizer)"):
            self._setup()
        self._warm_start()
        if not self.leader:
            return follow(self)
        self._start_service()
        self.publisher = start_publisher(self)
        version = int(self.meta["version"])
        if self.resume:
            # Past every version ever published here, so no sampler takes the new weights for
            # old ones; versions after the checkpoint are set aside (trainer_jax.resume).
            version, discarded = continue_versions(self.run_dir / "weights",
                                                   version if self.restored else None)
            if discarded:
                self.console.print(f"weights v{discarded[0]}..v{discarded[-1]} were published after the "
                                   "restored checkpoint: moved to weights/discarded/")
        self.meta["version"] = version
        summary = {"run_dir": str(self.run_dir), "formats": self.weight_formats(),
                    "mesh": {a: int(self.mesh.shape[a]) for a in self.mesh.axis_names},
                    "devices": int(self.mesh.size), "processes": self.lockstep.count}
        history = self.meta["history"]
        failed, started = True, False
        try:
            with Phase(self.console, f"publishing weights v{version}"):
                paths = self.publisher.publish_now(version, self._snapshot())
            started = True  # from here on a stop leaves a checkpoint
            if self.sync:
                self.sync.release(version)
            self._start_samplers(paths)
            if not self.resume or "eval_start" not in history:
                history["eval_start"] = self.evaluate("start")
                self.sink.write(self.meta["step"], history["eval_start"])
            self._loop()
            self.publisher.close()  # the last requested version is on disk before the final eval
            self.console.print(self.publisher.bytes_summary())
            history["eval_end"] = self.evaluate("end")
            self.sink.write(self.meta["step"], history["eval_end"])
            failed = False
        finally:
            self.samplers.stop()
            self.publisher.close()
            self.service.stop()
            try:
                if started:
                    self._save_checkpoint()
            finally:
                self._order(STOP, failed)
                self.lockstep.finish()
                self.sink.close()
                self.checkpointer.close()
        plots = plot_run(self.run_dir)
        summary.update(steps=self.meta["step"], eval_start=history.get("eval_start", {}),
                       eval_end=history.get("eval_end", {}), publish_errors=self.publisher.errors,
                       weights=self.publisher.bytes_summary(),
                       probe=probe_summary(self.service.status(), self.service.probes),
                       cost=self.cost.ledger.summary(),
                       plots=[str(p) for p in plots])
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    def _loop(self) -> None:
        cfg = self.cfg
        self.cost.start()  # the first step is charged from here (the ledger is built in _setup)
        with StepProgress(self.console, cfg.run.steps, self.meta["step"], cfg.train.log_every) as progress:
            while self.meta["step"] < cfg.run.steps:
                t0 = time.perf_counter()
                groups = (self.sync.take(self._take, cfg.train.prompts_per_step, self.meta["version"])
                          if self.sync else self._take(cfg.train.prompts_per_step))
                t1 = time.perf_counter()
                inputs, batch, samples, taken, rewards = self._batch(groups)
                if self.calibrator:  # the next publish calibrates on the newest trained samples
                    self.calibrator.observe(samples[i].token_ids for i in taken)
                if self.sync:  # what did not fit is of this version: never train it later
                    self.carry_dropped, self.carry = self.carry_dropped + len(self.carry), []
                self._save_trajectories(samples, taken)
                fault_point("learner_step")
                result = self._train_step(inputs, batch)
                t2 = time.perf_counter()
                self.meta["step"] += 1
                step = self.meta["step"]
                values = self._step_metrics(groups, samples, taken, rewards, result, t1 - t0, t2 - t1)
                values.update(self.source.metrics(groups))
                values.update(self._adv_values)
                values.update(episode_metrics(groups, self.meta["version"]))
                self.episode_log.write(step, groups, self.meta["version"])
                values["samplers/restarts"] = self.samplers.restarts
                values.update(self.cost.step(self.service, self.group_names, samples, taken, values))
                if self.sync:  # the next step's tasks wait for this version, announced
                    self.meta["version"] += 1
                    self.publisher.publish_now(self.meta["version"], self._snapshot())
                    self.sync.release(self.meta["version"])
                    values["sync/dropped_groups_total"] = self.sync.dropped_groups
                elif step % cfg.train.publish_every == 0:
                    self.meta["version"] += 1
                    self.publisher.request(self.meta["version"], during("publish", self._snapshot()))
                if failure := storage_failure(self.publisher.errors):
                    raise StorageError(f"weights publication failed, stopping: {failure}")
                if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < cfg.run.steps:
                    values.update(self.evaluate(f"step {step}"))
                alarms = self.alarms.update(values["reward_mean"], values.get("k3"),
                                            values.get("termination/empty_reply", 0.0),
                                            call_rate=values.get("tool/call_rate"))
                alarms += lag_alarms(values)
                for line in self.service.probes.alarms[self._probe_alarms_seen:]:
                    progress.print(f"[red]alarm[/red] step {step}: {line}")
                self._probe_alarms_seen = len(self.service.probes.alarms)
                for line in self._adv_alarms:
                    progress.print(f"[red]alarm[/red] step {step}: {line}")
                for alarm in self.alarms.transitions(alarms):
                    progress.print(f"[red]alarm[/red] step {step}: {alarm}")
                values["alarms"] = len(alarms)
                self.sink.write(step, values)
                if step % cfg.train.checkpoint_every == 0:
                    self._save_checkpoint()
                progress.advance(
                    f"reward {values['reward_mean']:.3f} k3 {values.get('k3', float('nan')):.2e} "
                    f"oor {values.get('out_of_range', float('nan')):.3f} |g| {result.grad_norm:.2f} "
                    f"idle {values['trainer_idle_share']:.0%}" + status_text(values) + probe_line(values)
                    + (f" sampler restarts {self.samplers.restarts}" if self.samplers.restarts else ""))

    def _save_trajectories(self, samples: list[Sample], taken) -> None:
        """Opt-in (``MIXRL_SAVE_TRAJECTORIES=N``): keep up to N trained samples of the latest step.

        Written as ``trajectories.pkl`` in the run dir (overwritten each step, so the file holds the
        last step's batch) for offline analysis such as ``trainer_jax.report.drift_gradients``;
        off by default, so ordinary runs are unchanged.
        """
        n = int(os.environ.get("MIXRL_SAVE_TRAJECTORIES", "0") or 0)
        if n <= 0:
            return
        import pickle

        keep = [samples[i] for i in list(taken)[:n]]
        record = {"step": self.meta["step"] + 1, "trainer_version": int(self.meta["version"]),
                  "group_names": self.group_names, "samples": keep}
        tmp = self.run_dir / "trajectories.pkl.tmp"
        tmp.write_bytes(pickle.dumps(record))
        tmp.replace(self.run_dir / "trajectories.pkl")

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
