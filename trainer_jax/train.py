"""`mixrl-train`: the fully asynchronous loop.

The trainer process runs the rollout service (gRPC, in threads) and the learner (main thread);
local sampler groups run as ``mixrl-sample`` subprocesses, each with its own precision recipe.
Each step takes the first P complete prompt groups from the buffer, whichever sampler produced
them and whatever weights version they were generated with (no staleness cap unless
``train.max_staleness``), computes group-relative advantages and the corrected objective, and
takes an optax step. Every ``publish_every`` steps the new weights are exported in every format a
group loads by a background publisher, so the next step never waits for a publish; samplers
reload in flight. Checkpoints (orbax) hold the learner and the loop state; ``--resume``
continues from the last one with fresh tasks (the task cursor is part of the checkpoint).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from rich.console import Console

from convert.publish import publish
from convert.qwen3_config import Qwen3Config
from convert.tokenizer import char_tokenizer, load_tokenizer, special_token_ids
from trainer_jax import env_tasks
from trainer_jax.batching import Sample, pack
from trainer_jax.checkpoint import Checkpointer
from trainer_jax.config import RunConfig
from trainer_jax.diagnostics import CollapseAlarms, MetricsSink, alarm_settle_steps, plot_run
from trainer_jax.learner import Learner
from trainer_jax.models import Qwen3, init_model, iter_hf_tensors, load_hf
from trainer_jax.objective import compute_advantages, reduce_metrics
from trainer_jax.service.auth import generate_token
from trainer_jax.service.server import RolloutService
from trainer_jax.service.tasks import build_task_source
from trainer_jax.sft import warm_start

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def build_policy(cfg: RunConfig, vocab_size: int,
                 special_ids: dict[str, int] | None = None) -> tuple[Qwen3, Qwen3Config]:
    """The initial policy: an HF checkpoint if configured, else a tiny random Qwen3.

    ``special_ids`` (``{"bos", "eos", "pad"}`` -> id, from the tokenizer) go into the new model's
    config, so the published checkpoints name the tokens the tokenizer actually uses.
    """
    m = cfg.model
    dtype = _DTYPES[m.dtype]
    if m.hf_dir:
        return load_hf(m.hf_dir, dtype=dtype, param_dtype=jnp.float32)
    qcfg = Qwen3Config(
        vocab_size=vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads, head_dim=m.head_dim,
        tie_word_embeddings=m.tie_word_embeddings, num_experts=m.num_experts,
        num_experts_per_tok=m.num_experts_per_tok, moe_intermediate_size=m.moe_intermediate_size,
        extra={f"{k}_token_id": v for k, v in (special_ids or {}).items()})
    return init_model(qcfg, dtype=dtype, param_dtype=jnp.float32, seed=m.seed), qcfg


def group_formats(cfg: RunConfig) -> list[str]:
    """Weight formats to publish: bf16 (evaluation, and the lingua franca) plus each group's."""
    from sampler_torch.recipes import get_recipe

    formats = ["bf16"] + [get_recipe(g.recipe).weight_format for g in cfg.groups]
    return list(dict.fromkeys(formats))


def to_sample(record, prompt_ids, group_index: int) -> Sample:
    """A validated wire trajectory (tokens after the prompt) as a learner ``Sample`` (whole sequence)."""
    p = len(record.logprobs)
    prompt = np.asarray(prompt_ids, np.int32)
    indptr = record.support_indptr if record.support_indptr is not None else np.zeros(p + 1, np.int32)
    return Sample(
        token_ids=np.concatenate([prompt, record.token_ids]),
        loss_mask=np.concatenate([np.zeros(len(prompt), record.loss_mask.dtype), record.loss_mask]),
        logprobs=record.logprobs,
        head_ids=record.head_ids, head_logprobs=record.head_logprobs, support_indptr=indptr,
        support_ids=record.support_ids if record.support_ids is not None else np.zeros(0, np.int32),
        support_logprobs=(record.support_logprobs if record.support_logprobs is not None
                          else np.zeros(0, np.float32)),
        versions=record.versions, reward=float(record.reward or 0.0), group=group_index,
        task_id=record.task_id, sample_index=record.sample_index)


class Publisher:
    """Exports weight versions off the training thread; the newest request wins.

    The training thread hands over a host snapshot of the parameters (the only work it does);
    if a publish is still running when the next one is requested, the older pending request is
    dropped, so a slow disk delays samplers' weights, never the learner.
    """

    def __init__(self, out_root: Path, config: dict, formats: list[str], tokenizer_dir: Path,
                 keep_last: int, on_published):
        self.out_root, self.config, self.formats = out_root, config, formats
        self.tokenizer_dir, self.keep_last, self.on_published = tokenizer_dir, keep_last, on_published
        self._pending: tuple[int, dict] | None = None
        self._cond = threading.Condition()
        self._stop = False
        self.errors: list[str] = []
        self.published: list[int] = []
        self._thread = threading.Thread(target=self._run, name="mixrl-publisher", daemon=True)
        self._thread.start()

    def publish_now(self, version: int, tensors: dict) -> dict[str, Path]:
        paths = publish(tensors, self.config, self.out_root, version, self.formats,
                        keep_last=self.keep_last, tokenizer_dir=self.tokenizer_dir)
        self.published.append(version)
        self.on_published(version, paths)
        return paths

    def request(self, version: int, tensors: dict) -> None:
        with self._cond:
            self._pending = (version, tensors)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._stop:
                    self._cond.wait()
                if self._pending is None:  # stopping, nothing left to publish
                    return
                version, tensors = self._pending
                self._pending = None
            try:
                self.publish_now(version, tensors)
            except Exception as e:  # keep training; samplers keep the previous version
                self.errors.append(f"v{version}: {type(e).__name__}: {e}")

    def close(self) -> None:
        """Finish the pending publish, if any, and stop (idempotent)."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join()


def snapshot(model: Qwen3) -> dict[str, np.ndarray]:
    return dict(iter_hf_tensors(model))


# What a run leaves in its directory; a fresh run finding any of them sets the old run aside.
_RUN_ARTIFACTS = ("checkpoints", "weights", "metrics.jsonl", "summary.json")


def set_aside_previous_run(run_dir: Path) -> Path | None:
    """Rename an earlier run in ``run_dir`` to ``<run_dir>.previous-<time>``; return where it went.

    A fresh run must not mix with an earlier one: its first weights (v0) would be the oldest
    version next to the earlier run's and be pruned at once, and checkpoints and metrics would
    interleave. Nothing is deleted; ``--resume`` continues the earlier run instead.
    """
    if not any((run_dir / name).exists() for name in _RUN_ARTIFACTS):
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = run_dir.with_name(f"{run_dir.name}.previous-{stamp}")
    n = 1
    while aside.exists():
        n += 1
        aside = run_dir.with_name(f"{run_dir.name}.previous-{stamp}-{n}")
    os.replace(run_dir, aside)
    return aside


class Trainer:
    def __init__(self, cfg: RunConfig, *, resume: bool = False, console: Console | None = None):
        self.cfg = cfg
        self.console = console or Console()
        self.run_dir = Path(cfg.run.dir).absolute()
        if not resume and (aside := set_aside_previous_run(self.run_dir)) is not None:
            self.console.print(f"an earlier run in {self.run_dir} was moved to {aside} "
                               "(--resume continues a run instead)")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.resume = resume
        self.group_names = [g.name for g in cfg.groups]
        self.processes: list[subprocess.Popen] = []
        self.carry: list[tuple[Sample, float]] = []
        self.carry_dropped = 0
        self.too_long = 0

    # ------------------------------------------------------------------ setup

    def _setup(self) -> None:
        cfg, run = self.cfg, self.run_dir
        self.tokenizer = load_tokenizer(cfg.model.hf_dir) if cfg.model.hf_dir else char_tokenizer()
        self.tokenizer_dir = run / "tokenizer"
        self.tokenizer_dir.mkdir(exist_ok=True)
        self.tokenizer.save(str(self.tokenizer_dir / "tokenizer.json"))
        self.model, self.qcfg = build_policy(cfg, self.tokenizer.get_vocab_size(),
                                             special_token_ids(self.tokenizer))
        objective = cfg.objective.model_copy(update={"num_groups": max(1, len(cfg.groups))})
        self.learner = Learner(self.model, cfg.optimizer, objective)
        self.checkpointer = Checkpointer(run / "checkpoints", keep_last=cfg.train.keep_checkpoints)
        self.meta = {"step": 0, "version": 0, "task_cursor": 0, "sft_done": False, "history": {}}
        if self.resume and self.checkpointer.latest_step() is not None:
            self.meta = self.checkpointer.restore(self.model, self.learner.optimizer)
            self.console.print(f"resumed from step {self.meta['step']} (weights v{self.meta['version']})")
        self.sink = MetricsSink(run)
        self.alarms = CollapseAlarms(settle_steps=alarm_settle_steps(cfg.optimizer.warmup_steps))
        self.source = build_task_source(cfg.tasks)
        if hasattr(self.source, "cursor"):
            self.source.cursor = int(self.meta["task_cursor"])
        self.eval_source = (env_tasks.EnvTaskSource(
            env_tasks.mix_specs(cfg.tasks), seed=cfg.train.eval_seed, tokenizer=self.tokenizer,
            prefix="eval") if cfg.tasks.mix else None)

    def _warm_start(self) -> None:
        cfg = self.cfg
        if cfg.sft.steps == 0 or self.meta["sft_done"] or self.eval_source is None:
            return
        with self.console.status("[bold]supervised warm start") as status:
            def on_step(step, loss):
                status.update(f"[bold]supervised warm start[/bold] step {step + 1}/{cfg.sft.steps} "
                              f"loss {loss:.3f}")
                if step % 10 == 0 or step == cfg.sft.steps - 1:
                    self.sink.write(step - cfg.sft.steps, {"sft/loss": loss})

            losses = warm_start(self.model, self.eval_source.envs, cfg.sft,
                                np.random.default_rng(cfg.run.seed), on_step=on_step)
        self.meta["sft_done"] = True
        self.console.print(f"warm start: {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")

    def _start_service(self) -> None:
        token = generate_token()
        self.token_file = self.run_dir / "token"
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token)
        self.service = RolloutService.from_config(self.cfg, token=token, source=self.source).start()
        self.console.print(f"rollout service on {self.service.address}")

    def _spawn_samplers(self, paths: dict[str, Path]) -> None:
        from sampler_torch.recipes import get_recipe

        logs = self.run_dir / "logs"
        logs.mkdir(exist_ok=True)
        for g in self.cfg.groups:
            if not g.spawn:
                continue
            fmt = get_recipe(g.recipe).weight_format
            for i in range(g.processes):
                cmd = [sys.executable, "-m", "sampler_torch.cli", "--trainer", self.service.address,
                       "--group", g.name, "--recipe", g.recipe, "--model-dir", str(paths[fmt]),
                       "--token-file", str(self.token_file), "--capacity", str(g.capacity),
                       "--threads", str(g.threads), "--episode-tokens", str(self.cfg.train.episode_tokens),
                       "--weights-transfer", "shared", "--name", f"{g.name}-{i}",
                       "--weights-cache", str(self.run_dir / "sampler_cache")]
                for key in ("attention", "kv_cache_dtype"):
                    if getattr(g, key) is not None:
                        cmd += ["--recipe-override", f"{key}={getattr(g, key)}"]
                log = open(logs / f"{g.name}-{i}.log", "ab")
                self.processes.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                       start_new_session=True))
        self.console.print(f"started {len(self.processes)} sampler processes "
                           f"({', '.join(f'{g.name}:{g.recipe}' for g in self.cfg.groups if g.spawn)})")
        self._wait_for_samplers(len(self.processes))

    def _wait_for_samplers(self, expected: int) -> None:
        """Block until the spawned samplers have registered, so no group starts the race late."""
        deadline = time.monotonic() + self.cfg.train.sampler_start_timeout_s
        while True:
            registered = len(self.service.status()["samplers"])
            if registered >= expected:
                return
            dead = [p for p in self.processes if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{len(dead)} sampler process(es) exited during start-up; see "
                                   f"{self.run_dir / 'logs'}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {registered} of {expected} samplers registered within "
                                   f"train.sampler_start_timeout_s={self.cfg.train.sampler_start_timeout_s}s")
            time.sleep(0.2)

    def _stop_samplers(self) -> None:
        for p in self.processes:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.processes:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, bf16_dir: Path, label: str) -> dict[str, float]:
        """pass@1 and pass@k of the bf16 policy on held-out tasks (the engine, bf16 recipe)."""
        cfg = self.cfg.train
        if self.eval_source is None or cfg.eval_tasks == 0:
            return {}
        from sampler_torch.engine import Engine, SamplingParams
        from sampler_torch.rollout import run_episodes

        engine = Engine(bf16_dir, "bf16", max_batch=32)
        s = self.cfg.tasks.sampling
        params = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, head_k=1,
                                max_new_tokens=s.max_new_tokens)
        tasks = [self.eval_source.task(n) for n in range(cfg.eval_tasks)]
        episodes, owners = [], []
        for t, (task, env) in enumerate(tasks):
            for _ in range(cfg.eval_k):
                episodes.append(env.start(task))
                owners.append(t)
        try:
            records = run_episodes(engine.generate, episodes, params, max_total_tokens=cfg.episode_tokens,
                                   seeds=[cfg.eval_seed + i for i in range(len(episodes))])
        finally:
            for ep in episodes:
                ep.close()
        wins = np.zeros((cfg.eval_tasks, cfg.eval_k))
        seen = Counter()
        for owner, rec in zip(owners, records, strict=True):
            wins[owner, seen[owner]] = rec.reward > 0
            seen[owner] += 1
        result = {"eval/pass@1": float(wins.mean()), f"eval/pass@{cfg.eval_k}": float(wins.max(1).mean())}
        self.console.print(f"eval ({label}): pass@1 {result['eval/pass@1']:.3f}, "
                           f"pass@{cfg.eval_k} {result[f'eval/pass@{cfg.eval_k}']:.3f}")
        return result

    # ------------------------------------------------------------------ the loop

    def _batch(self, groups) -> tuple:
        cfg = self.cfg
        rewards = np.asarray([[t.reward or 0.0 for t in g.trajectories] for g in groups], np.float32)
        adv = np.asarray(compute_advantages(jnp.asarray(rewards), cfg.train.advantage))
        # Samples that did not fit the previous batch go first (their advantages were computed
        # with their own prompt group); at most one batch of them is carried, the rest dropped.
        samples, sample_adv = [s for s, _ in self.carry], [a for _, a in self.carry]
        index = {name: i for i, name in enumerate(self.group_names)}
        for g, a in zip(groups, adv, strict=True):
            for t, ai in zip(g.trajectories, a, strict=True):
                sample = to_sample(t, g.task.prompt_ids, index.get(t.group, 0))
                if len(sample.token_ids) > cfg.train.row_len:  # cannot be packed: count, skip
                    self.too_long += 1
                    continue
                samples.append(sample)
                sample_adv.append(ai)
        inputs, batch, taken = pack(
            samples, np.asarray(sample_adv, np.float32), rows=cfg.train.rows, row_len=cfg.train.row_len,
            max_tokens=cfg.train.max_tokens, head_k=cfg.tasks.sampling.head_k, support_k=cfg.train.support_k,
            temperature=cfg.tasks.sampling.temperature, trainer_version=self.meta["version"],
            max_staleness=cfg.train.max_staleness)
        left = sorted(set(range(len(samples))) - set(taken))
        budget = cfg.train.prompts_per_step * cfg.tasks.group_size
        self.carry = [(samples[i], sample_adv[i]) for i in left][:budget]
        self.carry_dropped += max(0, len(left) - budget)
        return inputs, batch, samples, taken, rewards

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
        reasons = Counter(t.finish_reason for t in trajectories)
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
        return values

    def _on_published(self, version: int, paths: dict[str, Path]) -> None:
        self.service.publish_version(version, {k: str(v) for k, v in paths.items()})

    def run(self) -> dict:
        cfg = self.cfg
        self._setup()
        self._warm_start()
        self._start_service()
        formats = group_formats(cfg)
        self.publisher = Publisher(self.run_dir / "weights", self.qcfg.to_hf_dict(), formats,
                                   self.tokenizer_dir, cfg.train.keep_versions, self._on_published)
        version = int(self.meta["version"])
        if self.resume and version > 0:
            version += 1  # a fresh directory: the killed run may have half-announced its last one
        self.meta["version"] = version
        paths = self.publisher.publish_now(version, snapshot(self.model))
        summary = {"run_dir": str(self.run_dir), "formats": formats}
        try:
            if not self.resume or "eval_start" not in self.meta["history"]:
                self.meta["history"]["eval_start"] = self.evaluate(paths["bf16"], "start")
                self.sink.write(self.meta["step"], self.meta["history"]["eval_start"])
            self._spawn_samplers(paths)
            self._loop()
            self.publisher.close()  # the last requested version is on disk before the final eval
            self.meta["history"]["eval_end"] = self.evaluate(self._latest_bf16(), "end")
            self.sink.write(self.meta["step"], self.meta["history"]["eval_end"])
        finally:
            self._stop_samplers()
            self.publisher.close()
            self.service.stop()
            self._save_checkpoint()
            self.sink.close()
            self.checkpointer.close()
        plots = plot_run(self.run_dir)
        summary.update(steps=self.meta["step"], eval_start=self.meta["history"].get("eval_start", {}),
                       eval_end=self.meta["history"].get("eval_end", {}),
                       publish_errors=self.publisher.errors, plots=[str(p) for p in plots])
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    def _latest_bf16(self) -> Path:
        return self.run_dir / "weights" / f"v{self.publisher.published[-1]:08d}" / "bf16"

    def _save_checkpoint(self) -> None:
        self.meta["task_cursor"] = int(getattr(self.source, "cursor", 0))
        self.checkpointer.save(self.meta["step"], self.model, self.learner.optimizer, self.meta)

    def _loop(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        cfg = self.cfg
        total = cfg.run.steps
        progress = Progress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(),
                            TextColumn("{task.description}"), console=self.console, transient=False)
        with progress:
            bar = progress.add_task("", total=total, completed=self.meta["step"])
            while self.meta["step"] < total:
                t0 = time.perf_counter()
                groups = self._take(cfg.train.prompts_per_step)
                t1 = time.perf_counter()
                inputs, batch, samples, taken, rewards = self._batch(groups)
                self._save_trajectories(samples, taken)
                result = self.learner.step(inputs, batch)
                t2 = time.perf_counter()
                self.meta["step"] += 1
                step = self.meta["step"]
                values = self._step_metrics(groups, samples, taken, rewards, result, t1 - t0, t2 - t1)
                if step % cfg.train.publish_every == 0:
                    self.meta["version"] += 1
                    self.publisher.request(self.meta["version"], snapshot(self.model))
                if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < total:
                    values.update(self.evaluate(self._latest_bf16(), f"step {step}"))
                alarms = self.alarms.update(values["reward_mean"], values.get("k3"),
                                            values.get("termination/empty_reply", 0.0))
                for alarm in self.alarms.transitions(alarms):
                    progress.console.print(f"[red]alarm[/red] step {step}: {alarm}")
                values["alarms"] = len(alarms)
                self.sink.write(step, values)
                if step % cfg.train.checkpoint_every == 0:
                    self._save_checkpoint()
                progress.update(bar, advance=1, description=(
                    f"reward {values['reward_mean']:.3f} k3 {values.get('k3', float('nan')):.2e} "
                    f"oor {values.get('out_of_range', float('nan')):.3f} |g| {result.grad_norm:.2f} "
                    f"idle {values['trainer_idle_share']:.0%}"))

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

    def _take(self, n: int):
        deadline = time.monotonic() + self.cfg.train.take_timeout_s
        groups = []
        while len(groups) < n:
            groups += self.service.buffer.take_groups(n - len(groups), timeout=1.0)
            dead = [p for p in self.processes if p.poll() is not None]
            if self.processes and len(dead) == len(self.processes):
                raise RuntimeError(f"every sampler process exited; see {self.run_dir / 'logs'}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {n} complete prompt groups within train.take_timeout_s="
                                   f"{self.cfg.train.take_timeout_s}s (got {len(groups)})")
        return groups


def train(cfg: RunConfig, *, resume: bool = False, console: Console | None = None) -> dict:
    return Trainer(cfg, resume=resume, console=console).run()


__all__ = ["Publisher", "Trainer", "build_policy", "train"]
