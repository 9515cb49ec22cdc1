"""Run configs: YAML files validated by pydantic models, with ``key.sub=value`` overrides.

One config system for every entry point. Unknown keys are errors (a typo must not silently fall
back to a default), and every error names the offending key.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    """The policy: an HF directory to start from, or a tiny random Qwen3 for local runs."""

    hf_dir: str | None = None
    vocab: Literal["char"] = "char"
    hidden_size: int = Field(64, gt=0)
    intermediate_size: int = Field(128, gt=0)
    num_hidden_layers: int = Field(2, gt=0)
    num_attention_heads: int = Field(4, gt=0)
    num_key_value_heads: int = Field(2, gt=0)
    head_dim: int = Field(16, gt=0)
    tie_word_embeddings: bool = True
    num_experts: int = Field(0, ge=0)
    num_experts_per_tok: int = Field(0, ge=0)
    moe_intermediate_size: int = Field(0, ge=0)
    seed: int = 0


class SamplerGroupConfig(_Strict):
    """One group of samplers sharing a precision setup."""

    name: str
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    attention: Literal["sdpa", "eager"] = "sdpa"


class RunSection(_Strict):
    name: str = "run"
    dir: str = "runs/run"
    seed: int = 0
    steps: int = Field(1, ge=0)


class MismatchProbeConfig(_Strict):
    """The sampler-vs-trainer mismatch probe: prompts sampled by each group, scored by the trainer."""

    prompts: int = Field(16, gt=0)
    prompt_len: int = Field(8, gt=0)
    max_new_tokens: int = Field(32, gt=0)
    temperature: float = Field(1.0, gt=0)


# ---------------------------------------------------------------------------------------------
# The rollout service (gRPC) and the tasks it serves.


class TLSConfig(_Strict):
    """Server TLS from PEM files; ``client_ca_file`` turns on mutual TLS (client certs required)."""

    cert_file: str | None = None
    key_file: str | None = None
    client_ca_file: str | None = None

    @model_validator(mode="after")
    def _pairs(self) -> TLSConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file must be given together")
        if self.client_ca_file is not None and self.cert_file is None:
            raise ValueError("client_ca_file (mutual TLS) needs cert_file and key_file")
        return self

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None


class BufferConfig(_Strict):
    """Bounds on accepted-but-not-yet-trained trajectories; leases stop when they are reached."""

    max_trajectories: int = Field(4096, gt=0)
    max_bytes: int = Field(2 * 1024**3, gt=0)


class ServiceLimitsConfig(_Strict):
    max_message_bytes: int = Field(64 * 1024**2, ge=1024)
    max_outstanding_per_sampler: int = Field(256, gt=0)
    # A session whose rejections reach this is revoked (PERMISSION_DENIED): a broken or hostile
    # sampler must not burn the service's CPU forever.
    max_rejections_per_sampler: int = Field(10_000, gt=0)
    max_trajectory_tokens: int = Field(65_536, gt=0)
    max_concurrent_rpcs: int = Field(512, gt=0)


class RouterConfig(_Strict):
    """How the lease budget is split across sampler groups (see trainer_jax.service.router)."""

    policy: str = "throughput"
    pin_groups: bool = True  # all G samples of a prompt go to one group (one lease)
    ema_alpha: float = Field(0.3, gt=0, le=1)
    interval_s: float = Field(1.0, gt=0)
    min_share: float = Field(0.05, ge=0, lt=1)


class ServiceConfig(_Strict):
    listen: str = "127.0.0.1:50051"
    token_file: str | None = None  # else the MIXRL_TOKEN environment variable
    tls: TLSConfig = TLSConfig()
    max_workers: int = Field(64, gt=0)
    lease_ttl_s: float = Field(300.0, gt=0)
    session_ttl_s: float = Field(15.0, gt=0)
    heartbeat_s: float = Field(3.0, gt=0)
    buffer: BufferConfig = BufferConfig()
    limits: ServiceLimitsConfig = ServiceLimitsConfig()
    router: RouterConfig = RouterConfig()
    # `mixrl-train serve`: publish this directory as version 0 (an HF dir in `weights_format`, or
    # a directory of per-format HF dirs such as convert.publish writes).
    weights_dir: str | None = None
    weights_format: str = "bf16"
    vocab_size: int | None = Field(None, gt=0)  # default: weights' config.json, else the tokenizer

    @model_validator(mode="after")
    def _listen_and_ttls(self) -> ServiceConfig:
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise ValueError(f"listen must be HOST:PORT, got {self.listen!r}")
        if self.heartbeat_s >= self.session_ttl_s:
            raise ValueError(f"heartbeat_s ({self.heartbeat_s}) must be below session_ttl_s "
                             f"({self.session_ttl_s})")
        return self


class TaskSamplingConfig(_Strict):
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    head_k: int = Field(20, gt=0)
    max_new_tokens: int = Field(16, gt=0)
    stop_at_eos: bool = True


class ArithmeticTasksConfig(_Strict):
    max_operand: int = Field(99, ge=0)
    operations: str = "+"

    @model_validator(mode="after")
    def _ops(self) -> ArithmeticTasksConfig:
        if not self.operations or set(self.operations) - set("+-*"):
            raise ValueError(f"operations must be a non-empty string of + - *, got {self.operations!r}")
        return self


class TasksConfig(_Strict):
    """Where the service's tasks come from (trainer_jax.service.tasks registry)."""

    env: str = "arithmetic"
    group_size: int = Field(4, gt=0)  # G samples per prompt
    count: int | None = Field(None, gt=0)  # None: endless
    seed: int = 0
    sampling: TaskSamplingConfig = TaskSamplingConfig()
    arithmetic: ArithmeticTasksConfig = ArithmeticTasksConfig()


class RunConfig(_Strict):
    run: RunSection = RunSection()
    model: ModelConfig = ModelConfig()
    groups: list[SamplerGroupConfig] = Field(default_factory=lambda: [SamplerGroupConfig(name="bf16")])
    probe: MismatchProbeConfig = MismatchProbeConfig()
    service: ServiceConfig = ServiceConfig()
    tasks: TasksConfig = TasksConfig()

    @model_validator(mode="after")
    def _unique_group_names(self) -> RunConfig:
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"sampler group names must be unique, got {names}")
        return self


class ConfigError(ValueError):
    """A config file or override is malformed; the message names the key."""


def apply_override(tree: dict[str, Any], override: str) -> None:
    """Apply ``a.b.c=value`` to a nested dict; ``value`` is parsed as YAML (``3``, ``true``, ``[1]``)."""
    if "=" not in override:
        raise ConfigError(f"override {override!r} is not of the form key=value")
    key, raw = override.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {override!r} has an empty key part")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {part!r} is not a section")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"override {override!r}: value is not valid YAML ({e})") from None


def load_config(path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file {p} does not exist")
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p} is not valid YAML ({e})") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{p}: top level must be a mapping")
    for override in overrides:
        apply_override(tree, override)
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors())
        raise ConfigError(f"invalid config{f' {path}' if path else ''}: {problems}") from None
