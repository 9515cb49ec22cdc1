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

from trainer_jax.learner import OptimizerConfig
from trainer_jax.objective import ObjectiveConfig
from trainer_jax.sft import SFTConfig


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
    dtype: Literal["float32", "bfloat16"] = "float32"  # the trainer's compute dtype (params stay fp32)


class SamplerGroupConfig(_Strict):
    """One group of samplers sharing a precision recipe (sampler_torch.recipes).

    ``spawn``: the trainer starts ``processes`` local ``mixrl-sample`` processes for the group;
    otherwise the group's samplers join by address on their own.
    """

    name: str
    recipe: str = "bf16"
    attention: Literal["sdpa", "eager"] | None = None  # None: the recipe's default
    kv_cache_dtype: str | None = None  # None: the recipe's default
    processes: int = Field(1, ge=0)
    capacity: int = Field(8, gt=0)
    threads: int = Field(1, gt=0)
    spawn: bool = True


class RunSection(_Strict):
    name: str = "run"
    dir: str = "runs/run"
    seed: int = 0
    steps: int = Field(1, ge=0)


class TrainConfig(_Strict):
    """The asynchronous loop: batch shape, cadences, staleness, evaluation."""

    prompts_per_step: int = Field(8, gt=0)  # P prompt groups (of G samples each) per step
    advantage: str = "grpo"  # a name in trainer_jax.objective.ADVANTAGE_ESTIMATORS
    publish_every: int = Field(1, gt=0)
    checkpoint_every: int = Field(10, gt=0)
    keep_checkpoints: int = Field(2, gt=0)
    keep_versions: int = Field(3, gt=0)
    max_staleness: int | None = Field(None, ge=0)  # None: no cap (the design's default)
    rows: int = Field(16, gt=0)
    row_len: int = Field(128, gt=0)
    max_tokens: int = Field(1024, gt=0)
    support_k: int = Field(64, gt=0)
    episode_tokens: int = Field(160, gt=0)  # token budget of a multi-turn episode
    take_timeout_s: float = Field(600.0, gt=0)
    sampler_start_timeout_s: float = Field(180.0, gt=0)
    eval_every: int = Field(10, ge=0)  # 0: only before and after training
    eval_tasks: int = Field(32, ge=0)
    eval_k: int = Field(4, gt=0)
    eval_seed: int = 10_007


class MixEntry(_Strict):
    """One environment of a task mix: its share, difficulty and constructor options."""

    env: str
    weight: float = Field(1.0, gt=0)
    difficulty: int = Field(1, ge=1)
    options: dict[str, Any] = Field(default_factory=dict)


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
    mix: list[MixEntry] = Field(default_factory=list)  # with env: mix (trainer_jax.env_tasks)


# ---------------------------------------------------------------------------------------------
# Scale-out: the device mesh and multi-process JAX (trainer_jax.parallel, docs/scale_out.md).

_MESH_AXES = ("data", "fsdp", "expert", "tensor")


class MeshConfig(_Strict):
    """Sizes of the named mesh axes; their product is the number of devices.

    ``data``/``fsdp``/``expert``/``tensor`` are the sizes within one slice (TPU) or host (GPU),
    where devices share the fast interconnect; ``-1`` on one axis means "every device the others
    leave" (the default: pure data parallelism). ``dcn_data``/``dcn_fsdp`` multiply the data and
    fsdp axes across slices or hosts (the slow network). ``rules`` overrides the logical-axis
    table of ``trainer_jax.parallel.rules``, e.g. ``{embed: [fsdp, data]}``.
    """

    data: int = -1
    fsdp: int = 1
    expert: int = 1
    tensor: int = 1
    dcn_data: int = Field(1, gt=0)
    dcn_fsdp: int = Field(1, gt=0)
    rules: dict[str, list[str]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _sizes(self) -> MeshConfig:
        sizes = {a: getattr(self, a) for a in _MESH_AXES}
        bad = [a for a, n in sizes.items() if n == 0 or n < -1]
        if bad:
            raise ValueError(f"mesh axis sizes must be >= 1 or -1 (the rest), got "
                             f"{ {a: sizes[a] for a in bad} }")
        if sum(n == -1 for n in sizes.values()) > 1:
            raise ValueError(f"at most one mesh axis may be -1, got {sizes}")
        for logical, axes in self.rules.items():
            unknown = set(axes) - set(_MESH_AXES)
            if unknown:
                raise ValueError(f"rules.{logical}: unknown mesh axes {sorted(unknown)}; "
                                 f"expected a subset of {list(_MESH_AXES)}")
        return self


class DistributedConfig(_Strict):
    """Multi-process JAX (``jax.distributed.initialize``): one process per TPU VM / GPU host.

    ``mode``: ``off`` never initialises (one process); ``on`` always does (unset fields are
    auto-detected by JAX: TPU metadata, SLURM, Open MPI); ``auto`` initialises only when a
    coordinator is configured or a multi-process launcher is detected. The environment variables
    ``MIXRL_COORDINATOR_ADDRESS``, ``MIXRL_NUM_PROCESSES``, ``MIXRL_PROCESS_ID`` and
    ``MIXRL_LOCAL_DEVICE_IDS`` override the fields, so one config file serves every process.
    """

    mode: Literal["auto", "on", "off"] = "auto"
    coordinator_address: str | None = None
    num_processes: int | None = Field(None, gt=0)
    process_id: int | None = Field(None, ge=0)
    local_device_ids: list[int] | None = None
    initialization_timeout_s: int = Field(300, gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> DistributedConfig:
        if self.coordinator_address is not None:
            host, sep, port = self.coordinator_address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"coordinator_address must be HOST:PORT, got "
                                 f"{self.coordinator_address!r}")
        if (self.process_id is not None and self.num_processes is not None
                and self.process_id >= self.num_processes):
            raise ValueError(f"process_id {self.process_id} must be below num_processes "
                             f"{self.num_processes}")
        return self


class RunConfig(_Strict):
    run: RunSection = RunSection()
    model: ModelConfig = ModelConfig()
    groups: list[SamplerGroupConfig] = Field(default_factory=lambda: [SamplerGroupConfig(name="bf16")])
    service: ServiceConfig = ServiceConfig()
    tasks: TasksConfig = TasksConfig()
    train: TrainConfig = TrainConfig()
    objective: ObjectiveConfig = ObjectiveConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    sft: SFTConfig = SFTConfig(steps=0)
    mesh: MeshConfig = MeshConfig()
    distributed: DistributedConfig = DistributedConfig()

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
