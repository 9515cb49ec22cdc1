"""OpenEnv environments: episodes step an OpenEnv server through the package's own client.

``env: openenv`` with ``options: {url: http://host:port}`` (Meta's OpenEnv, PyPI package
``openenv`` 0.10, the ``openenv`` extra; ``openenv-core`` 0.3 is the older name of the same
code). Each episode is one session of the server (``GenericEnvClient``, a WebSocket at
``<url>/ws``, one environment instance per session): ``reset`` gives the first observation, which
is the prompt; each policy turn's text (up to the stop token) is sent as the action
``{action_field: text}``; each observation comes back as text tokens (the environment's,
loss-masked), the server's rewards are summed into the episode's reward, and the server's
``done`` ends it (termination ``answered``; ``turn_limit`` after ``max_turns`` turns).

The prompt must be the same every time a task is started (the trainer starts it once for the
prompt, the sampler again for the episode): a task is a seed, passed to ``reset(seed=...)``, so the
server's first observation must follow from the seed (or not vary). Text only: observations are
rendered as ``observation_field``'s value, or every field as ``name: value`` lines; image and
tensor observations are not supported. Docker image references (``from_docker_image``) need
Docker: not supported here, run the server and give its ``url``. On a sampler this runs in
worker processes with ``options.timeout_s`` per call (``envs.isolated``), as every environment
not built into ``envs`` does.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from envs.base import Environment, Episode, StepResult, Task

SUPPORTED = "openenv>=0.10,<0.11"


class OpenEnvOptions(BaseModel):
    """The options of ``env: openenv`` (``timeout_s`` is ``envs.isolated``'s, checked apart)."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="the server's base URL, http(s):// or ws(s)://")
    action_field: str = Field("message", description="the action field the reply text goes in")
    observation_field: str | None = Field(None, description="the observation field shown to the "
                                          "model; None: every field as 'name: value' lines")
    reset: dict[str, Any] = Field(default_factory=dict, description="extra reset() arguments")
    max_turns: int = Field(8, ge=1, le=1000)
    client_timeout_s: float = Field(60.0, gt=0, le=3600, description="the client's message timeout")

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        if not url.startswith(("http://", "https://", "ws://", "wss://")):
            raise ValueError(f"url must start with http://, https://, ws:// or wss://, got {url!r}")
        return url.rstrip("/")


def _client(opts: OpenEnvOptions):
    try:
        from openenv.core.generic_client import GenericEnvClient
    except ImportError as e:
        raise RuntimeError(f"env openenv needs the OpenEnv client: pip install 'mixrl[openenv]' "
                           f"({SUPPORTED}; {type(e).__name__}: {e})") from None
    return GenericEnvClient(base_url=opts.url, connect_timeout_s=min(30.0, opts.client_timeout_s),
                            message_timeout_s=opts.client_timeout_s).sync()


def render(observation: Any, field: str | None) -> str:
    """The text the model sees of an observation (a dict from the generic client)."""
    if not isinstance(observation, dict):
        return str(observation)
    if field is not None:
        if field not in observation:
            raise KeyError(f"observation has no field {field!r} (fields: {sorted(observation)})")
        return str(observation[field])
    return "\n".join(f"{k}: {v}" for k, v in observation.items() if k != "metadata" and v not in (None, ""))


class OpenEnvEpisode(Episode):
    def __init__(self, env: OpenEnv, seed: int):
        self.env, self.turns, self.total = env, 0, 0.0
        self.client = _client(env.opts)
        try:
            first = self.client.reset(seed=seed, **env.opts.reset)
            self.prompt = env.encode(render(first.observation, env.opts.observation_field) + "\n")
        except BaseException:
            self.close()
            raise
        self.stop_token_ids = tuple(t for t in (env.eos,) if t is not None) or (env.encode("\n")[-1],)

    def step(self, generated: list[int]) -> StepResult:
        self.turns += 1
        ids = list(generated)
        if ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        text = self.env.decode(ids).strip()
        try:
            result = self.client.step({self.env.opts.action_field: text})
        except Exception as e:  # noqa: BLE001 - the server refused the action or went away
            self.note_error("server_error" if "Server error" in str(e) else "connection")
            return StepResult([], self.total, True, "error")
        reward = 0.0 if result.reward is None else float(result.reward)
        if not math.isfinite(reward):
            self.note_error("bad_reward")
            reward = 0.0
        self.total += reward
        if result.done:
            return StepResult([], self.total, True, "answered")
        if self.turns >= self.env.opts.max_turns:
            return StepResult([], self.total, True, "turn_limit")
        text = render(result.observation, self.env.opts.observation_field)
        return StepResult(self.env.encode(text + "\n"), 0.0, False)

    def close(self) -> None:
        client, self.client = getattr(self, "client", None), None
        if client is not None:
            client.close()


class OpenEnv(Environment):
    """An OpenEnv server's environment; one task per seed (see the module docstring)."""

    name = "openenv"
    Options = OpenEnvOptions

    def __init__(self, tokenizer, difficulty: int = 1, **options: Any):
        super().__init__(tokenizer, difficulty)
        self.opts = OpenEnvOptions.model_validate(options)

    def sample_task(self, rng, task_id: str) -> Task:
        return Task(task_id, self.name, {"seed": int(rng.integers(0, 2**31 - 1))})

    def start(self, task: Task) -> Episode:
        return OpenEnvEpisode(self, int(task.payload["seed"]))
