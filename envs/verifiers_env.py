"""``env: verifiers``: Prime Intellect's ``verifiers`` 0.4 environments (``verifiers.v1``).

``options: {id: <taskset id or module>, args: {...}}`` loads the environment as ``verifiers``'
own loader does (``verifiers.v1.load_environment(EnvConfig)``: the taskset package ``id`` with
its config fields ``args``, its bundled ``Env`` or ``SingleAgentEnv``, or the ``Env`` named by
``env``). Its taskset is the task source: task ``n`` of the mix is the taskset's task
``n mod len`` (in ``load()`` order; an infinite taskset is read as far as needed), its data the
task's payload; the evaluation source reads the taskset built with ``eval_args`` (a held-out
split) instead of ``args``.

An episode is ``Env.run_episode`` on a background event loop (``Env.serving()`` held open for
the environment's life): its harness calls the rollout's interception endpoint, whose training
client (``TrainClient``: the ``renderers`` renderer of the model, tokens in and out) calls
``/inference/v1/generate`` on a loopback endpoint of this process (``envs.verifiers_endpoint``).
Each such call is one policy turn of the mixrl episode: the first call's token ids are the prompt,
and each later call's token ids must extend the episode's tokens so far (prompt, generated turns,
observations): the extension is the observation (loss-masked), so the trajectory is never
re-tokenised. A call that does not extend them (the renderer could not bridge the turn and
re-rendered the conversation) ends the episode with reward 0, counted as ``bridge_miss``. When
``run_episode`` returns, the episode's reward is the sum of its traces' rewards (each reward
function's value times its weight, the rubric's score); a failed episode (``Episode.ok`` false)
ends ``error``, counted as ``vf_<error type>``.

On samplers this runs in worker processes like every outside environment (``envs.isolated``,
``options.timeout_s`` per call: the first call and each turn's answer must come within it).
The trainer starts each task once for its prompt (up to the first call, then cancels it).
``verifiers.legacy`` (0.3's API) is not supported: ``verifiers`` 0.4 no longer ships it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import queue
import re
import sys
import threading
import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from envs.base import Environment, Episode, StepResult, Task
from envs.isolated_worker import WORKER_ENV
from envs.verifiers_endpoint import Call, GenerateEndpoint

log = logging.getLogger("mixrl.envs")
SUPPORTED = "verifiers>=0.4,<0.5"
#: Seconds the environment may take to make its first model call, or to answer after a turn,
#: when it runs in this process (on samplers ``options.timeout_s`` bounds each call instead).
WAIT_S = 600.0


class VerifiersOptions(BaseModel):
    """The options of ``env: verifiers`` (``timeout_s`` is ``envs.isolated``'s, checked apart)."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(description="the taskset: an installed package or importable module")
    env: str = Field("", description="an Env id to pair with the taskset (default: the taskset's own)")
    args: dict[str, Any] = Field(default_factory=dict, description="the taskset's config fields")
    eval_args: dict[str, Any] | None = Field(None, description="the taskset's config fields for "
                                             "evaluation (a held-out split); default: args")
    config: dict[str, Any] = Field(default_factory=dict, description="more EnvConfig fields "
                                   "(e.g. {agent: {max_turns: 4}})")
    harness: dict[str, Any] | None = Field(default_factory=lambda: {"id": "mixrl_chat"},
                                           description="the harness of roles that pin none; None: "
                                           "the taskset's default (bash, installed with uv)")
    runtime: dict[str, Any] | None = Field(default_factory=lambda: {"type": "subprocess"},
                                           description="every role's runtime; None: the env's own "
                                           "(verifiers' default is Prime's remote sandboxes)")
    renderer: dict[str, Any] | None = Field(None, description="a renderers.RendererConfig "
                                            "(e.g. {name: qwen3}); default: chosen from the model")
    renderer_model: str | None = Field(None, description="the tokenizer the renderer loads; "
                                       "default: the model directory of the run's tokenizer")
    max_model_len: int | None = Field(None, gt=0, description="what GET /v1/models reports")


def _verifiers():
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise RuntimeError(f"env verifiers needs the verifiers package: pip install 'mixrl[verifiers]' "
                           f"({SUPPORTED}; {type(e).__name__}: {e})") from None
    from envs import verifiers_chat

    # Harness ids are looked up under verifiers.v1.harnesses (else as a top-level module).
    sys.modules.setdefault(f"verifiers.v1.harnesses.{verifiers_chat.HARNESS_ID}", verifiers_chat)
    return vf


def env_config(opts: VerifiersOptions, args: dict[str, Any]):
    """The ``verifiers`` ``EnvConfig`` of ``opts`` with taskset fields ``args``."""
    vf = _verifiers()
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.runtimes import RuntimeConfig
    from verifiers.v1.utils.loaders import harness_config_type

    raw = {**opts.config, "id": opts.env, "taskset": {**args, "id": opts.id}}
    cfg = vf.resolve_env_config(raw)
    for role, agent in agent_config_fields(cfg).items():
        update: dict[str, Any] = {}
        if opts.harness is not None and agent.harness is None:
            update["harness"] = harness_config_type(opts.harness["id"]).model_validate(opts.harness)
        if opts.runtime is not None:
            from pydantic import TypeAdapter

            update["runtime"] = TypeAdapter(RuntimeConfig).validate_python(opts.runtime)
        setattr(cfg, role, agent.model_copy(update=update))
    return cfg


class _Loop:
    """A background event loop holding one ``verifiers`` env's ``serving()`` open."""

    def __init__(self, vf_env):
        self.vf_env = vf_env
        self.loop = asyncio.new_event_loop()
        self._ready, self._stop = threading.Event(), None
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name="vf-env", daemon=True)
        self.thread.start()
        self._ready.wait()
        if self.failure is not None:
            raise RuntimeError(f"the verifiers environment failed to start serving: "
                               f"{type(self.failure).__name__}: {self.failure}") from self.failure

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._serve())
        except BaseException as e:  # noqa: BLE001 - reported to the constructor / logged
            self.failure = e
            self._ready.set()
        finally:
            self.loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with self.vf_env.serving():
            self._ready.set()
            await self._stop.wait()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        if self.thread.is_alive() and self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
            self.thread.join(30)


def _reason(error_type: str) -> str:
    """``vf_<error type in snake case>``, a metric name (``envs.base.finish_reason``)."""
    snake = re.sub(r"(?<!^)(?=[A-Z])", "_", error_type).lower()
    return ("vf_" + re.sub(r"[^a-z0-9_]", "", snake))[:40] or "vf_error"


class VerifiersEpisode(Episode):
    """One ``run_episode`` of the ``verifiers`` env, turned into mixrl turns (module doc)."""

    #: the episode driver hands over each turn's behaviour log-probs (``turn_logprobs``) before
    #: ``step``: the training client checks that every token has one.
    wants_logprobs = True

    def __init__(self, env: VerifiersEnvironment, vf_task, wait_s: float):
        self.env, self.wait_s = env, wait_s
        self.model = f"mixrl-{uuid.uuid4().hex[:12]}"
        self.turn_logprobs: list[float] | None = None
        self.reward_values: dict[str, float] = {}
        self.result = None  # the finished verifiers Episode
        self._events = env.endpoint.route(self.model)
        self._call: Call | None = None
        self._future = None
        vf = _verifiers()
        ctx = vf.ModelContext(model=self.model, client=env.client_config, sampling=vf.SamplingConfig())
        try:
            self._future = env.loop().submit(env.vf_env.run_episode(vf_task, ctx))
            self._future.add_done_callback(lambda f: self._events.put(("done", f)))
            kind, value = self._next()
            if kind != "call":
                raise RuntimeError(f"the episode ended before its first model call ({self._outcome(value)})")
        except BaseException:
            self.close()
            raise
        self._call = value
        self.prompt = list(value.prompt_ids)
        self.tokens = list(self.prompt)
        stops = value.stop_token_ids or [t for t in (env.eos,) if t is not None]
        self.stop_token_ids = tuple(stops)

    def _next(self):
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                return self._events.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                pass
            loop = self.env.loop()
            if not loop.thread.is_alive():
                raise RuntimeError(f"the verifiers event loop stopped ({loop.failure!r})")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no model call and no end of the episode in {self.wait_s:g} s")

    def _outcome(self, future) -> str:
        if future.cancelled():
            return "cancelled"
        if future.exception() is not None:
            e = future.exception()
            return f"{type(e).__name__}: {e}"
        episode = future.result()
        errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
        return "; ".join(f"{e.type}: {e.message}"[:300] for e in errors) or "no error"

    def step(self, generated: list[int]) -> StepResult:
        call, self._call = self._call, None
        if call is None:
            raise RuntimeError("step after the episode ended")
        logprobs = self.turn_logprobs
        self.turn_logprobs = None
        if logprobs is None or len(logprobs) != len(generated):
            logprobs = [0.0] * len(generated)  # in-process use without a driver's record
        stopped = bool(generated) and generated[-1] in self.stop_token_ids
        call.answer(generated, [lp if math.isfinite(lp) else -1e4 for lp in logprobs],
                    "stop" if stopped else "length")
        self.tokens += list(generated)
        kind, value = self._next()
        if kind == "call":
            n = len(self.tokens)
            if value.prompt_ids[:n] != self.tokens:
                value.fail(409, "the prompt does not extend the episode's tokens (bridge miss)")
                self.note_error("bridge_miss")
                self.close()
                return StepResult([], 0.0, True, "error")
            self._call = value
            observation = list(value.prompt_ids[n:])
            self.tokens += observation
            return StepResult(observation, 0.0, False)
        return self._finish(value)

    def _finish(self, future) -> StepResult:
        if future.cancelled() or future.exception() is not None:
            self.note_error("vf_exception")
            self.env.log_once("exception", f"run_episode raised: {self._outcome(future)}")
            return StepResult([], 0.0, True, "error")
        episode = self.result = future.result()
        reward = 0.0
        for trace in episode.traces:
            if not trace.agent.trainable:
                continue
            reward += trace.reward
            for name, r in trace.rewards.items():
                if r is not None:
                    self.reward_values[name] = self.reward_values.get(name, 0.0) + r.score
        if not episode.ok:
            errors = list(episode.errors) + [e for t in episode.traces for e in t.errors]
            reason = _reason(errors[-1].type) if errors else "vf_not_ok"
            self.note_error(reason)
            self.env.log_once(reason, f"episode not ok: {self._outcome(future)}")
            return StepResult([], 0.0, True, "error")
        if not math.isfinite(reward):
            self.note_error("bad_reward")
            reward = 0.0
        return StepResult([], float(reward), True, "answered")

    @property
    def reward_parts(self) -> dict[str, float]:
        """Each rubric reward function's score, summed over the episode's trainable traces."""
        return dict(self.reward_values)

    def close(self) -> None:
        """Cancel the run if it is still going (the turn budget ended it) and release its route."""
        future, self._future = self._future, None
        if self._call is not None:
            self._call.fail(499, "the episode ended")
            self._call = None
        if future is not None and not future.done():
            future.cancel()
            try:
                future.result(timeout=30)
            except BaseException:  # noqa: BLE001 - cancelled (or failed while cancelling): ended
                pass
        while True:  # calls the cancelled run made meanwhile: refused
            try:
                kind, value = self._events.get_nowait()
            except queue.Empty:
                break
            if kind == "call":
                value.fail(499, "the episode ended")
        self.env.endpoint.unroute(self.model)


_DELEGATES: dict[str, Any] = {}
_DELEGATES_LOCK = threading.Lock()


def _delegate(tokenizer, difficulty: int, options: dict[str, Any]):
    """The worker pool that starts episodes for ``options`` outside a worker, one per distinct
    entry in this process (the trainer's task and evaluation sources build the same entry twice;
    each worker imports ``verifiers`` and loads the renderer, which is slow)."""
    import json

    from convert.tokenizer import source_dir
    from envs.isolated import IsolatedEnvironment

    key = json.dumps([str(source_dir(tokenizer)), difficulty, options], sort_keys=True, default=str)
    with _DELEGATES_LOCK:
        if key not in _DELEGATES:
            _DELEGATES[key] = IsolatedEnvironment("verifiers", tokenizer, difficulty, options)
        return _DELEGATES[key]


class VerifiersEnvironment(Environment):
    """A ``verifiers.v1`` environment's taskset and episodes (see the module docstring)."""

    name = "verifiers"
    Options = VerifiersOptions

    def __init__(self, tokenizer, difficulty: int = 1, **options: Any):
        super().__init__(tokenizer, difficulty)
        self.options = dict(options)  # with timeout_s when the mix entry has one (the delegate's)
        self.opts = VerifiersOptions.model_validate({k: v for k, v in options.items() if k != "timeout_s"})
        self._delegate = None
        self._args = self.opts.args
        vf = _verifiers()
        try:
            self.vf_env = vf.load_environment(env_config(self.opts, self._args))
        except Exception as e:  # noqa: BLE001 - the user's package / config: one line
            from envs.loading import EnvLoadError

            message = " ".join(str(e).split())[:300]
            raise EnvLoadError(f"environment verifiers (id {self.opts.id!r}): cannot load it "
                               f"({type(e).__name__}: {message})") from None
        self._tasks: list = []
        self._iter = None
        self._loop: _Loop | None = None
        self._endpoint: GenerateEndpoint | None = None
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self.wait_s = WAIT_S
        if os.environ.get(WORKER_ENV):  # a worker: the slow part now, within its start-up limit
            self.warm()

    def warm(self) -> None:
        """Start serving and load the renderer (its tokenizer), which the first call needs."""
        from verifiers.v1.clients.train import ElasticRendererPool

        cfg = self.client_config
        pool = ElasticRendererPool(cfg.renderer_model_name, cfg.renderer, multiplex=cfg.multiplex)
        self.loop().submit(pool.grow()).result(timeout=self.wait_s)

    def for_evaluation(self) -> VerifiersEnvironment:
        """The same environment over the taskset built with ``eval_args`` (itself without them)."""
        if self.opts.eval_args is None:
            return self
        other = VerifiersEnvironment(self.tokenizer, self.difficulty,
                                     **{**self.options, "args": self.opts.eval_args})
        other.chat_template_kwargs = self.chat_template_kwargs
        return other

    # -- tasks (the trainer's side) --------------------------------------------------------
    def _task_at(self, i: int):
        with self._lock:
            if self._iter is None:
                self._iter = iter(self.vf_env.taskset)
            while len(self._tasks) <= i and self._iter is not None:
                nxt = next(self._iter, None)
                if nxt is None:
                    self._iter = None
                else:
                    self._tasks.append(nxt)
            if not self._tasks:
                raise RuntimeError(f"verifiers taskset {self.opts.id!r} has no tasks")
            if i < len(self._tasks):
                return self._tasks[i]
            return self._tasks[i % len(self._tasks)]

    def sample_task_at(self, rng, task_id: str, draw: int) -> Task:
        task = self._task_at(draw)
        return Task(task_id, self.name, {"data": task.data.model_dump(mode="json", exclude_none=True)})

    def sample_task(self, rng, task_id: str) -> Task:
        """A random task: of the whole taskset, or of an infinite one's first 1,024."""
        self._task_at(0)
        n = len(self._tasks) if self._iter is None else 1024
        return self.sample_task_at(rng, task_id, int(rng.integers(0, n)))

    # -- episodes --------------------------------------------------------------------------
    @property
    def endpoint(self) -> GenerateEndpoint:
        with self._lock:
            if self._endpoint is None:
                self._endpoint = GenerateEndpoint(self.tokenizer.get_vocab_size(with_added_tokens=True),
                                                  self.opts.max_model_len)
            return self._endpoint

    def loop(self) -> _Loop:
        with self._lock:
            if self._loop is None:
                self._loop = _Loop(self.vf_env)
            return self._loop

    @property
    def client_config(self):
        vf = _verifiers()
        from convert.tokenizer import source_dir

        model = self.opts.renderer_model or (str(source_dir(self.tokenizer) or "") or None)
        if model is None:
            raise RuntimeError("env verifiers: the renderer needs a tokenizer directory: set "
                               "options.renderer_model (the run's tokenizer was not loaded from one)")
        return vf.TrainClientConfig(base_url=self.endpoint.base_url, api_key_var="MIXRL_VERIFIERS_KEY",
                                    renderer=self.opts.renderer, renderer_model_name=model)

    def start(self, task: Task) -> Episode:
        """The episode, run here in a worker process (``envs.isolated_worker``); elsewhere (the
        trainer, which starts each task for its prompt) in one: rendering loads the model's
        tokenizer with ``transformers``, which imports torch, and the trainer never does."""
        if not os.environ.get(WORKER_ENV):
            with self._lock:
                if self._delegate is None:
                    self._delegate = _delegate(self.tokenizer, self.difficulty,
                                               {**self.options, "args": self._args})
            return self._delegate.start(task)
        vf_task = self._vf_task(task.payload)
        return VerifiersEpisode(self, vf_task, self.wait_s)

    def _vf_task(self, payload: dict[str, Any]):
        taskset = self.vf_env.taskset
        cls = type(taskset).task_type()
        data = cls.data_type().model_validate(payload["data"])
        return cls(data, taskset.config.task)

    def log_once(self, reason: str, message: str) -> None:
        if reason not in self._logged:
            self._logged.add(reason)
            log.error("environment verifiers (%s): %s (counted as errors/%s; later ones counted, "
                      "not logged)", self.opts.id, message, reason)

    def close(self) -> None:
        self._delegate = None  # shared (_delegate): its workers end with the process
        loop, self._loop = self._loop, None
        endpoint, self._endpoint = self._endpoint, None
        if endpoint is not None:
            endpoint.close()
        if loop is not None:
            loop.close()


__all__ = ["SUPPORTED", "VerifiersEnvironment", "VerifiersEpisode", "VerifiersOptions", "env_config"]
