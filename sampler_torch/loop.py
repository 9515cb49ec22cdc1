"""The sampler loop: lease tasks, generate with the engine, submit trajectories, follow weights.

Three threads share one ``RolloutClient``:

- the main loop leases up to ``capacity`` samples, runs them as one batch through the engine
  (environments registered in ``envs`` run their episodes, turn by turn; other
  tasks are a single generation from the prompt), and submits the trajectories on one stream;
- a heartbeat keeps the session alive and reports the weights version in use;
- a watcher follows the trainer's published versions, obtains each in this sampler's weight
  format (shared path or chunked download), verifies every file against the sha256 manifest and
  only then hands it to ``engine.load_weights``, which swaps between decode steps. Any failure
  keeps the current weights and is counted (``weight_failures``, reported in heartbeats). After
  each load it answers the version probe (``sampler_torch.probe``): the trainer may ask for a
  reload, or revoke the session (the loop then stops).

The engine is duck-typed (``generate(prompts, params_list)``, ``load_weights(dir, version)``,
``version``), so another backend with the same surface drops in. The trainer's
``train.partial_rollouts`` (in the registration) reaches it through
``set_partial_rollouts(bool)``: whether a request may span a reload, or every in-flight request
finishes on the old weights first; a backend without that hook keeps its own reload behaviour
(logged once).
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from envs import ENVIRONMENTS, make_env
from envs import Task as EnvTask
from envs.base import finish_reason
from envs.isolated import EnvCallFailed, IsolatedEnvironment, build_env, failed_episode
from envs.rollout import run_episodes
from mixrl_wire import pb
from mixrl_wire.encoder import encode_trajectory
from mixrl_wire.probe import PROBE_FILE
from mixrl_wire.sampling import SamplingParams
from sampler_torch.client import RolloutClient, RolloutError
from sampler_torch.probe import digest, verify_load, weight_files

log = logging.getLogger("mixrl.sampler")

#: ``SamplerLoop._env`` of a mix entry that cannot be built here
UNAVAILABLE = object()


@dataclasses.dataclass
class LoopConfig:
    capacity: int = 8                  # samples leased and generated per round
    weights_cache: str = "~/.cache/mixrl/weights"
    transfer: str = "auto"             # "auto" | "shared" | "fetch" (see RolloutClient.materialize_weights)
    use_envs: bool = True              # run sampler-side environments when the task names one
    episode_tokens: int | None = None  # total token budget of a multi-turn episode (None: single turn)
    max_samples: int | None = None     # stop after submitting this many (tests, benchmarks)


@dataclasses.dataclass
class LoopStats:
    rounds: int = 0
    generated: int = 0
    accepted: int = 0
    duplicates: int = 0
    refused: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    weight_versions: list[int] = dataclasses.field(default_factory=list)
    weight_failures: int = 0
    last_weight_error: str = ""
    probe_acks: list = dataclasses.field(default_factory=list)  # ProbeAck per verified load
    returned: int = 0  # samples given back: their environment cannot be built here


class SamplerLoop:
    def __init__(self, client: RolloutClient, engine: Any, cfg: LoopConfig | None = None,
                 make_params: Callable[..., Any] | None = None, tokenizer: Any = None):
        self.client = client
        self.engine = engine
        self.cfg = cfg or LoopConfig()
        self.stats = LoopStats()
        self.stop_event = threading.Event()
        self._stoppable: bool | None = None  # whether engine.generate takes should_stop
        self.active_samples = 0
        self._make_params = make_params or _engine_params
        self._tokenizer = tokenizer
        self._envs: dict[str, Any] = {}
        self._files: dict[str, str] | None = None  # weight files of the version served
        self._threads: list[threading.Thread] = []
        self._partial: bool | None = None  # the trainer's partial_rollouts, as last applied

    # ---------------------------------------------------------------- threads

    def _watch_weights(self) -> None:
        cache = Path(self.cfg.weights_cache).expanduser()
        start_dir = getattr(self.engine, "model_dir", None)
        self._files = weight_files(start_dir) if start_dir else None
        if start_dir and (Path(start_dir) / PROBE_FILE).is_file():  # the version it started on
            self._verify(self.engine.version, start_dir, before=None, changed=False)
        try:
            for wv in self.client.watch_weights(after_version=-1):
                if self.stop_event.is_set():
                    return
                if wv.version <= self.engine.version:
                    continue
                self._load(wv, cache)
        except RolloutError as e:
            if not self.stop_event.is_set():
                log.error("weights watch stopped: %s", e)

    def _load(self, wv: pb.WeightVersion, cache: Path) -> None:
        t0 = time.perf_counter()
        before = digest(self.engine)
        try:
            fmt, path = self.client.materialize_weights(wv, cache, self.cfg.transfer)
            self.engine.load_weights(path, wv.version)
        except Exception as e:  # noqa: BLE001 - any failure keeps the old weights serving
            self.stats.weight_failures += 1
            self.stats.last_weight_error = str(e)
            log.error("weights version %d refused, keeping version %d: %s", wv.version,
                      self.engine.version, e)
            return
        self.stats.weight_versions.append(wv.version)
        log.info("weights version %d (%s) verified and loaded in %.2f s", wv.version, fmt,
                 time.perf_counter() - t0)
        # Report the new version now, not at the next periodic heartbeat: the trainer leases
        # tasks that need it (synchronous mode, evaluation) only once it knows.
        try:
            resp = self.client.heartbeat(self.engine.version, self.stats.weight_failures, self.active_samples)
            self.client.expired_leases.update(resp.expired_lease_ids)
        except (RolloutError, ValueError) as e:  # ValueError: the channel closed under us
            if not self.client.closed:
                log.warning("heartbeat after loading version %d: %s", wv.version, e)
        files = weight_files(path)
        changed = files is not None and self._files is not None and files != self._files
        self._files = files
        self._verify(wv.version, path, before=before, changed=changed)

    def _verify(self, version: int, path, *, before: str | None, changed: bool) -> None:
        """Answer the version probe of a load; a revoked session stops the loop."""
        ack = verify_load(self.client, self.engine, version, path, before=before,
                          files_changed=changed,
                          reload=lambda: self.engine.load_weights(path, version))
        self.stats.probe_acks.append(ack)
        if ack is not None and ack.action == pb.ProbeAck.REVOKED:
            log.error("the trainer revoked this sampler: %s", ack.reason)
            self.stop()
            self.client.request_stop()  # no retry may register a new session behind its back

    def start_background(self) -> None:
        self._threads.append(self.client.start_heartbeat(
            lambda: (self.engine.version, self.stats.weight_failures, self.active_samples)))
        t = threading.Thread(target=self._watch_weights, name="mixrl-weights", daemon=True)
        t.start()
        self._threads.append(t)

    def stop(self) -> None:
        self.stop_event.set()

    # ---------------------------------------------------------------- main loop

    def run(self) -> LoopStats:
        """Lease, generate, submit until ``stop()`` (or ``max_samples`` submitted)."""
        self.follow_registration(self.client.register())
        self.start_background()
        try:
            while not self.stop_event.is_set():
                self.follow_registration(self.client.info)  # a restarted trainer may differ
                if self.cfg.max_samples is not None and self.stats.accepted >= self.cfg.max_samples:
                    break
                try:
                    resp = self.client.lease(self.cfg.capacity)
                except RolloutError as e:
                    if e.code == grpc.StatusCode.CANCELLED:
                        break
                    raise
                if not resp.tasks:
                    self.stop_event.wait(max(resp.retry_after_ms, 50) / 1000)
                    continue
                self.run_round(list(resp.tasks))
        finally:
            self.stop_event.set()
            for env in self._envs.values():  # outside environments' worker processes
                if isinstance(env, IsolatedEnvironment):
                    env.close()
        return self.stats

    def follow_registration(self, info: pb.RegisterResponse | None) -> None:
        """Hand the trainer's ``partial_rollouts`` (when it sent one) to the backend."""
        if info is None or not info.HasField("partial_rollouts"):
            return
        want = bool(info.partial_rollouts)
        if want == self._partial:
            return
        self._partial = want
        hook = getattr(self.engine, "set_partial_rollouts", None)
        if hook is None:
            log.warning("the trainer asks for partial_rollouts=%s but backend %s has no "
                        "set_partial_rollouts: it keeps its own reload behaviour", want,
                        type(self.engine).__name__)
            return
        hook(want)
        log.info("partial rollouts %s: %s", "on" if want else "off",
                 "requests may span a weights reload" if want
                 else "in-flight requests finish on the old weights before a reload")

    def run_round(self, tasks: list[pb.Task]) -> None:
        leased_at = time.perf_counter()
        tasks = self._runnable(tasks)
        if not tasks:
            return
        items = [(t, i) for t in tasks for i in t.sample_indices]
        self.active_samples = len(items)
        t0 = time.perf_counter()
        records = self._generate(items)
        gen_ms = (time.perf_counter() - t0) * 1000
        if any(str(r.get("finish_reason", "")).partition(";")[0] == "stopped" for r in records):
            # Told to stop mid-round: its episodes were cut short (``stopped``, ungraded), so none
            # is submitted; the leases expire and the trainer hands the tasks out again.
            self.active_samples = 0
            log.info("stopping: the %d samples of an unfinished round are not submitted", len(items))
            return
        self.active_samples = 0
        self.stats.rounds += 1
        self.stats.generated += len(items)
        trajs = []
        for (task, idx), rec in zip(items, records, strict=True):
            if task.lease_id in self.client.expired_leases:
                continue  # the trainer already re-queued it; submitting would only be refused
            # Straight to wire bytes: no protobuf arrays, no serialization pass (see encode_trajectory).
            trajs.append(encode_trajectory(task, idx, queue_ms=(t0 - leased_at) * 1000, generate_ms=gen_ms,
                                           session_id=self.client.session_id or "", **rec))
        for r in self.client.submit_many(trajs):
            if r.accepted:
                self.stats.accepted += not r.duplicate
                self.stats.duplicates += r.duplicate
            else:
                self.stats.refused[r.code.name] += 1
                if not (r.code == grpc.StatusCode.CANCELLED and self.client.closed):  # we stopped: not news
                    log.warning("sample %d/%d refused: %s %s", r.task_id, r.sample_index, r.code.name,
                                r.reason)

    # ---------------------------------------------------------------- generation

    def _mix(self) -> dict[str, pb.EnvSpec]:
        """The task mix the trainer sent at registration, by entry name (empty from a trainer
        that predates it: built-in environments by name then, with their default options)."""
        info = getattr(self.client, "info", None)
        return {e.name: e for e in info.envs} if info is not None else {}

    def _env(self, name: str):
        """The environment of ``Task.env`` ``name``: built (imported) on first use from the
        registration's mix entry; ``None``: plain generation from the prompt; ``UNAVAILABLE``: a
        mix entry that cannot be built here (its leases go back, ``_runnable``)."""
        if name not in self._envs:
            env = None
            spec = self._mix().get(name)
            if self.cfg.use_envs:
                try:
                    if spec is not None:  # an outside environment runs in worker processes
                        env = build_env(spec.env, self._get_tokenizer(),
                                        difficulty=max(1, spec.difficulty),
                                        options=json.loads(spec.options_json or "{}"))
                    elif name in ENVIRONMENTS:
                        env = make_env(name, self._get_tokenizer())
                except Exception as e:  # noqa: BLE001 - user code: never the end of the sampler
                    # A built-in environment that cannot be built here (an export without
                    # tokenizer files) falls back to plain generation as before: the trainer
                    # scores single-turn replies itself. An outside one goes back.
                    if spec is not None and spec.env not in ENVIRONMENTS:
                        log.error("environment %r (%s) cannot be built here (%s: %s); its leases "
                                  "go back to the trainer", name, spec.env, type(e).__name__, e)
                        env = UNAVAILABLE
                    else:
                        log.warning("environment %r unavailable (%s); generating from the prompt",
                                    name, e)
            self._envs[name] = env
        return self._envs[name]

    def _runnable(self, tasks: list[pb.Task]) -> list[pb.Task]:
        """``tasks`` without those whose environment cannot be built here: each of those leases
        is given back (``ReturnLease``, counted by the trainer), never generated wrong."""
        keep = []
        for t in tasks:
            if not (t.env and self._env(t.env) is UNAVAILABLE):
                keep.append(t)
                continue
            self.stats.returned += len(t.sample_indices)
            try:
                self.client.return_lease(t.lease_id, "env_unavailable", env=t.env)
            except RolloutError as e:  # the lease then ends at its deadline
                log.warning("returning lease %s: %s", t.lease_id, e)
        return keep

    def _get_tokenizer(self):
        if self._tokenizer is None:
            from convert.tokenizer import load_tokenizer
            self._tokenizer = load_tokenizer(self.engine.model_dir)
        return self._tokenizer

    def _generate(self, items: list[tuple[pb.Task, int]]) -> list[dict]:
        """Per item, the keyword arguments of ``encode_trajectory`` (tokens after the prompt)."""
        out: list[dict | None] = [None] * len(items)
        plain, episodic = [], collections.defaultdict(list)
        for k, (task, _) in enumerate(items):
            env = self._env(task.env) if task.env else None
            episode = self._episode(env, task) if env is not None else None
            if episode is None:
                plain.append(k)
            else:
                episodic[_params_key(task.sampling)].append((k, episode))
        if plain:
            prompts = [list(items[k][0].prompt_ids) for k in plain]
            params = [self._make_params(items[k][0].sampling, items[k][0].sampling.seed + items[k][1])
                      for k in plain]
            for k, c in zip(plain, self._engine_generate(prompts, params), strict=True):
                out[k] = _from_completion(c, items[k][0].sampling)
        for group in episodic.values():
            task0 = items[group[0][0]][0]
            # Each episode's own prompt + budget: one from task0's prompt would leave a longer
            # prompt fewer new tokens, or none (an empty trajectory the trainer refuses).
            extra = self.cfg.episode_tokens or task0.sampling.max_new_tokens
            budget = [len(items[k][0].prompt_ids) + extra for k, _ in group]
            seeds = [items[k][0].sampling.seed + items[k][1] for k, _ in group]
            try:
                recs = run_episodes(self._engine_generate, [ep for _, ep in group],
                                    self._make_params(task0.sampling, 0), max_total_tokens=budget,
                                    seeds=seeds, should_stop=self._should_stop)
            finally:
                for _, ep in group:
                    _close(ep)
            for (k, _), rec in zip(group, recs, strict=True):
                out[k] = _from_episode(rec, len(items[k][0].prompt_ids), items[k][0].sampling)
        return out  # type: ignore[return-value]

    def _engine_generate(self, prompts, params):
        """The backend's ``generate``, told to stop with the loop where it can be (the engine ends
        its requests within one decode step, ``finish_reason`` ``stopped``: the round is then not
        submitted); a backend without ``should_stop`` finishes its call first."""
        if self._stoppable is None:
            self._stoppable = "should_stop" in inspect.signature(self.engine.generate).parameters
        if self._stoppable:
            return self.engine.generate(prompts, params, should_stop=self._should_stop)
        return self.engine.generate(prompts, params)

    def _should_stop(self) -> bool:
        """Stop generating: told to, or the client gave up (the trainer is gone: nothing generated
        now could be submitted)."""
        return self.stop_event.is_set() or bool(getattr(self.client, "closed", False))

    def _episode(self, env, task: pb.Task):
        try:
            payload = json.loads(task.payload or b"{}")
            episode = env.start(EnvTask(str(task.task_id), task.env, payload))
        except EnvCallFailed as e:  # an outside environment failed: one turn, the reason counted
            return failed_episode(list(task.prompt_ids), tuple(task.sampling.stop_token_ids), e.reason)
        except Exception as e:  # noqa: BLE001 - a payload this env cannot read: plain generation
            log.warning("task %d: environment %r cannot start it (%s); generating from the prompt",
                        task.task_id, task.env, e)
            return None
        if list(episode.prompt) != list(task.prompt_ids):
            # The trainer scores against its own prompt; an episode on another one would be wrong.
            log.warning("task %d: environment prompt differs from the task's; generating from the prompt",
                        task.task_id)
            _close(episode)
            return None
        return episode


def _close(episode) -> None:
    """Close an episode; a failure to clean up (a sandbox the model left in a state the harness
    cannot remove) is logged, never the end of the sampler."""
    try:
        episode.close()
    except Exception as e:  # noqa: BLE001
        log.error("closing an episode failed: %s: %s", type(e).__name__, e)


def _params_key(s: pb.SamplingParams) -> tuple:
    return (s.temperature, s.top_p, s.top_k, s.head_k, s.max_new_tokens, tuple(s.stop_token_ids))


def _engine_params(s: pb.SamplingParams, seed: int) -> SamplingParams:
    return SamplingParams.from_pb(s, seed=seed)


def _from_completion(c, sampling: pb.SamplingParams) -> dict:
    rec = dict(token_ids=c.token_ids, logprobs=c.logprobs, logprobs_full=c.logprobs_full, versions=c.versions,
               head_ids=_rect(c.head_ids, len(c.token_ids), sampling.head_k, -1),
               head_logprobs=_rect(c.head_logprobs, len(c.token_ids), sampling.head_k, float("-inf")),
               finish_reason=c.finish_reason)
    if c.support_ids is not None:
        rec["support_ids"], rec["support_logprobs"] = c.support_ids, c.support_logprobs
    return rec


def _rect(rows, n: int, k: int, fill):
    import numpy as np

    if n == 0 or k == 0:
        return np.zeros((n, k), np.float32 if isinstance(fill, float) else np.int32)
    return np.asarray(rows).reshape(n, k)


def _from_episode(rec, prompt_len: int, sampling: pb.SamplingParams) -> dict:
    p = len(rec.logprobs)
    out = dict(token_ids=rec.token_ids[prompt_len:], loss_mask=rec.loss_mask[prompt_len:],
               logprobs=rec.logprobs, logprobs_full=rec.logprobs_full, versions=rec.versions,
               head_ids=rec.head_ids.reshape(p, sampling.head_k),
               head_logprobs=rec.head_logprobs.reshape(p, sampling.head_k),
               reward=rec.reward, finish_reason=finish_reason(rec.termination, rec.errors),
               reward_parts=rec.reward_parts or None)
    if len(rec.support_ids):
        rows = [rec.support_ids[rec.support_indptr[t]:rec.support_indptr[t + 1]] for t in range(p)]
        lps = [rec.support_logprobs[rec.support_indptr[t]:rec.support_indptr[t + 1]] for t in range(p)]
        out["support_ids"], out["support_logprobs"] = rows, lps
    return out
