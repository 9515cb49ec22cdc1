"""The run's own sections: ``run:``, ``train:`` (the loop), ``groups:`` and ``tasks:``."""

from __future__ import annotations

import os
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from mixrl_wire.devices import DeviceError, check_spec, gpu_sharing_problem, jax_platform
from mixrl_wire.recipes import KV_CACHE_DTYPES, RECIPES, get_recipe
from mixrl_wire.sampling import SamplingParams
from trainer_jax.config.base import Strict as _Strict
from trainer_jax.config.base import one_of


class RoundWeightsConfig(_Strict):
    """``groups[].round_weights``: K bits (2..8) and B inputs per block (a shorter tail block when
    B does not divide a projection's input size); ``sampler_torch.recipes.rounding``."""

    bits: int = Field(ge=2, le=8)
    block_size: int = Field(gt=0)


class SamplerGroupConfig(_Strict):
    """One group of samplers sharing a precision recipe (sampler_torch.recipes).

    ``processes``: the group's replica count, spawned or not: with ``spawn`` the trainer starts
    that many local ``mixrl-sample`` processes; otherwise the group's samplers join by address
    on their own and ``processes`` is how many a launcher starts (the Ray fleet, the planner's
    ``plan.yaml``). Cost accounting charges the replicas actually registered (``trainer_jax.cost``).
    ``min_processes`` / ``max_processes``: autoscaling bounds around ``processes`` (None: fixed).
    ``accelerator``: what a replica runs on (``H100``, ``B200``, ``cpu``): the key of the price
    table (top-level ``prices:``, ``mixrl-train --prices FILE``) and, on Ray, the resource; never
    a torch device name. A registering sampler whose reported device does not match it is a
    warning, not a refusal (``trainer_jax.cost.accelerator_mismatch``).
    ``price_per_hour``: USD per replica-hour; None: the price table's entry for ``accelerator``;
    neither: the group has no USD figures (not zero).
    ``resources``: what one replica asks of a scheduler (``num_cpus``, ``num_gpus``, ...).
    ``device``: where spawned samplers compute (``mixrl-sample --device``: ``auto``, ``cpu``,
    ``cuda``, ``cuda:N``; ``mixrl_wire.devices``). On a host whose GPUs the JAX trainer holds, a
    group on a GPU is refused at load unless the trainer's memory share was lowered
    (``XLA_PYTHON_CLIENT_MEM_FRACTION`` / ``XLA_PYTHON_CLIENT_PREALLOCATE=false``).
    """

    name: str
    recipe: str = "bf16"  # a name in mixrl_wire.recipes.RECIPES
    attention: Literal["auto", "sdpa", "eager"] | None = None  # None: the recipe's (auto)
    kv_cache_dtype: str | None = None  # None: the recipe's default
    # The mismatch dial (mixrl_wire.recipes): sigma of seeded Gaussian noise on the sampler's
    # logits, recorded in the group's registered recipe. None: the recipe's (0, off).
    logit_noise: float | None = Field(None, ge=0, allow_inf_nan=False)
    # The quantization-shaped dial (sampler_torch.recipes.rounding): every quantizable linear the
    # group serves rounded to symmetric per-block K-bit integers, scales from each loaded version.
    round_weights: RoundWeightsConfig | None = None
    # A group that leases only evaluation tasks (never training ones); train.eval_group may name
    # it, and the router gives it no training share.
    eval_only: bool = False
    processes: int = Field(1, ge=0)
    min_processes: int | None = Field(None, ge=0)
    max_processes: int | None = Field(None, ge=0)
    accelerator: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:+-]+$")
    price_per_hour: float | None = Field(None, ge=0, allow_inf_nan=False)
    resources: dict[str, float] = Field(default_factory=dict)
    capacity: int = Field(8, gt=0)
    threads: int = Field(1, gt=0)
    spawn: bool = True
    device: str = "auto"
    # The engine's compiled decode step (mixrl-sample --compile): auto = on CUDA, off on the CPU.
    compile: Literal["auto", "on", "off"] = "auto"

    @field_validator("device")
    @classmethod
    def _device_spec(cls, v: str) -> str:
        try:
            return check_spec(v)
        except DeviceError as e:
            raise ValueError(str(e)) from None

    @field_validator("resources")
    @classmethod
    def _resource_amounts(cls, v: dict[str, float]) -> dict[str, float]:
        for key, amount in v.items():
            if not key or amount < 0 or amount != amount or amount == float("inf"):
                raise ValueError(f"resources.{key}: must be a finite amount >= 0, got {amount}")
        return v

    @model_validator(mode="after")
    def _replica_bounds(self) -> SamplerGroupConfig:
        lo = self.min_processes if self.min_processes is not None else self.processes
        hi = self.max_processes if self.max_processes is not None else self.processes
        if not lo <= self.processes <= hi:
            raise ValueError(f"group {self.name!r}: needs min_processes <= processes <= max_processes, "
                             f"got {lo} <= {self.processes} <= {hi}")
        return self

    @model_validator(mode="after")
    def _gpu_not_held_by_trainer(self) -> SamplerGroupConfig:
        if self.spawn and self.processes > 0:
            try:
                problem = gpu_sharing_problem([self.device], os.environ, jax_platform(os.environ))
            except DeviceError as e:
                problem = str(e)
            if problem:
                raise ValueError(f"group {self.name!r}: {problem}")
        return self

    @model_validator(mode="after")
    def _round_weights_fit_the_recipe(self) -> SamplerGroupConfig:
        # The dial rounds float weights; a recipe quantizing activations runs its own kernel on
        # stored integer / fp8 parts (sampler_torch.recipes.rounding.check_recipe, same rule).
        if self.round_weights is not None:
            recipe = get_recipe(self.recipe)
            if recipe.activations != "none":
                raise ValueError(f"group {self.name!r}: round_weights needs a recipe that computes with "
                                 f"float weights (bf16, nvfp4_w4a16, mxfp4_w4a16); {self.recipe!r} "
                                 f"quantizes activations ({recipe.activations})")
        return self

    @field_validator("recipe")
    @classmethod
    def _known_recipe(cls, v: str) -> str:
        return one_of(v, RECIPES, "recipe")

    @field_validator("kv_cache_dtype")
    @classmethod
    def _known_kv_dtype(cls, v: str | None) -> str | None:
        return v if v is None else one_of(v, KV_CACHE_DTYPES, "KV cache dtype")

    @property
    def weight_format(self) -> str:
        """The weight format the group loads: the trainer publishes it with every version."""
        return get_recipe(self.recipe).weight_format


class RunSection(_Strict):
    name: str = "run"
    dir: str = "runs/run"
    seed: int = 0
    steps: int = Field(1, ge=0)


class WeightsConfig(_Strict):
    """``train.weights``: where published versions go and how (``convert.publish``).

    ``root``: a directory or an fsspec URL (``s3://bucket/prefix``) every sampler reads; None:
    ``<run dir>/weights``. ``delta``: write each format as a delta against its previous version
    (``convert.delta``), a full snapshot every ``full_every`` versions. ``calibrate``: before each
    publish, measure activation and K/V maxima with the policy on ``calibration_tokens`` tokens of
    recent trajectories and write the scales they give (nvfp4 ``input_scale``, FP8 KV
    ``k_scale``/``v_scale`` of the formats groups load with an fp8_e4m3 KV cache, at least
    ``kv_scale_floor``; ``trainer_jax.calibration``); false: those exports keep the uncalibrated
    1.0.
    """

    root: str | None = None
    delta: bool = True
    full_every: int = Field(10, gt=0)
    calibrate: bool = True
    # A few hundred tokens: enough for the maxima to settle, one short forward per version.
    calibration_tokens: int = Field(256, ge=16, le=65_536)
    # FP8 KV scales are max(amax / 448, kv_scale_floor): 1.0 is ModelOpt's export rule (the scale
    # only guards against overflow); 0 uses amax / 448 as is (convert/README.md has the measurement).
    kv_scale_floor: float = Field(1.0, ge=0, allow_inf_nan=False)

    @field_validator("root")
    @classmethod
    def _known_scheme(cls, v: str | None) -> str | None:
        # The URL's scheme is checked at load; access and credentials when the publisher starts.
        if v is not None and "://" in v:
            import fsspec

            scheme, rest = v.split("://", 1)
            if scheme not in fsspec.available_protocols():
                raise ValueError(f"weights root {v}: unknown URL scheme {scheme!r} (fsspec knows "
                                 "s3, gs, file, ...)")
            try:  # the implementation's package (s3fs, gcsfs) is installed
                fsspec.get_filesystem_class(scheme)
            except (ImportError, ValueError) as e:
                raise ValueError(f"weights root {v}: the {scheme} filesystem cannot be used here: "
                                 f"{' '.join(str(e).split())}") from None
            if scheme not in ("file", "local", "memory") and not rest.split("/", 1)[0]:
                raise ValueError(f"weights root {v}: no bucket or host after {scheme}://")
        elif v is not None and re.match(r"^[a-z][a-z0-9+.-]*:/[^/]", v):
            raise ValueError(f"weights root {v}: looks like a URL with one slash (write "
                             f"{v.split(':', 1)[0]}://...)")
        return v


class TrainConfig(_Strict):
    """The asynchronous loop: batch shape, cadences, staleness, evaluation."""

    prompts_per_step: int = Field(8, gt=0)  # P prompt groups (of G samples each) per step
    advantage: str = "grpo"  # a name in trainer_jax.objective.ADVANTAGE_ESTIMATORS
    publish_every: int = Field(1, gt=0)
    checkpoint_every: int = Field(10, gt=0)
    keep_checkpoints: int = Field(2, gt=0)
    keep_versions: int = Field(3, gt=0)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    max_staleness: int | None = Field(None, ge=0)  # None: no cap (the design's default)
    # Step s learns only from samples of weights version s (trainer_jax.sync): no policy lag.
    sync: bool = False
    # Whether a sampler's in-flight request may span a weights reload (its tokens then carry two
    # versions; long episodes are never held back). False: every backend finishes its in-flight
    # requests on the old weights before reloading. Sent to samplers when they register.
    partial_rollouts: bool = True
    rows: int = Field(16, gt=0)
    row_len: int = Field(128, gt=0)
    # Rows per forward/backward pass (None: all rows at once); must divide ``rows``. The step's
    # gradient is the whole batch's either way; this bounds the activation memory.
    micro_rows: int | None = Field(None, gt=0)
    # Rematerialisation per decoder layer: none | full | a jax.checkpoint_policies name.
    remat: str = "none"
    max_tokens: int = Field(1024, gt=0)
    # A shape that drops samples when replies run to their limit (trainer_jax.batch_shape) is an
    # error at start unless this is set; then it is one warning line with the share dropped.
    allow_drop: bool = False
    support_k: int = Field(64, gt=0)
    episode_tokens: int = Field(160, gt=0)  # token budget of a multi-turn episode
    take_timeout_s: float = Field(600.0, gt=0)
    sampler_start_timeout_s: float = Field(180.0, gt=0)
    # Sampler processes the trainer may start on its host: the sum of the spawned groups'
    # ``processes`` (a --plan's counts included). A typo (processes: 1000000) is refused at load,
    # not found after hundreds of processes have started.
    max_spawned_samplers: int = Field(64, gt=0)
    eval_every: int = Field(10, ge=0)  # 0: only before and after training
    eval_tasks: int = Field(32, ge=0)
    eval_k: int = Field(4, gt=0)
    eval_seed: int = 10_007
    # The sampler group that runs evaluation tasks (leased like training tasks, never trained
    # on). None: the first group that loads bf16 weights, else the first group.
    eval_group: str | None = None
    eval_timeout_s: float = Field(600.0, gt=0)
    # A plain progress line every this many steps when the console is not a terminal (logs).
    log_every: int = Field(10, gt=0)
    # Whole episodes kept per step in <run>/episodes/step_<n>.jsonl (trainer_jax.episode_log;
    # multi-turn ones first); 0: none.
    log_episodes: int = Field(4, ge=0)

    @field_validator("advantage")
    @classmethod
    def _known_advantage(cls, v: str) -> str:
        from trainer_jax.objective.advantages import ADVANTAGE_ESTIMATORS  # JAX, as remat below

        return one_of(v, ADVANTAGE_ESTIMATORS.names(), "advantage estimator")

    @field_validator("remat")
    @classmethod
    def _known_remat(cls, v: str) -> str:
        from trainer_jax.models.remat import remat_options  # JAX, only when a config is validated

        return one_of(v, remat_options(), "remat mode")

    @model_validator(mode="after")
    def _micro_rows_divide_rows(self) -> TrainConfig:
        if self.micro_rows is not None and self.rows % self.micro_rows:
            raise ValueError(f"micro_rows ({self.micro_rows}) must divide rows ({self.rows})")
        if self.sync and self.publish_every != 1:
            raise ValueError(f"sync: true publishes every step; publish_every must be 1, got "
                             f"{self.publish_every}")
        return self


class MixEntry(_Strict):
    """One environment of a task mix: its share, difficulty and constructor options.

    ``env``: a built-in name, an import path ``module:Class`` (any importable subclass of
    ``envs.base.Environment``) or an entry point of the ``mixrl.envs`` group (``envs.loading``).
    ``name``: what metrics (``env/<name>/...``) and tasks call the entry; default the built-in or
    entry point name, else the class name.
    """

    env: str
    name: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    weight: float = Field(1.0, gt=0)
    difficulty: int = Field(1, ge=1)
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _typed_options(self) -> MixEntry:
        # The class is imported and each environment's options checked (envs.options, or an
        # outside class's own model / keyword parameters): a misspelt module, class or option, a
        # wrong type or value is one line here, not a TypeError at the first episode. A
        # dataset's files are read and every row checked too (envs.dataset.check_options).
        from envs.loading import check_options, default_name, resolve_env

        cls = resolve_env(self.env)
        if self.env == "dataset":
            from envs.dataset import check_options as check_dataset

            check_dataset(self.options)
        else:
            check_options(self.env, cls, self.options)
        if self.name is None:  # the model is frozen: the default is set once, here
            object.__setattr__(self, "name", default_name(self.env, cls))
        return self


class TasksConfig(_Strict):
    """Where the service's tasks come from: one environment, or a weighted mix (``env: mix``).

    ``env`` names an environment of ``envs`` (``arithmetic``, ``reverse``, ``shell``, ...) or
    ``mix``, in which case ``mix`` lists the environments with their weights and options.
    ``sampling`` is the sampling of every task (``mixrl_wire.sampling.SamplingParams``; the
    environment adds its stop tokens, the service a per-task seed).
    """

    env: str = "arithmetic"
    group_size: int = Field(4, gt=0)  # G samples per prompt
    count: int | None = Field(None, gt=0)  # None: endless
    seed: int = 0
    sampling: SamplingParams = SamplingParams(max_new_tokens=16)
    mix: list[MixEntry] = Field(default_factory=list)  # with env: mix
    # Arguments of the model's chat template (Qwen3: ``{enable_thinking: false}``).
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _environments(self) -> TasksConfig:
        if self.sampling.temperature <= 0:
            # The trainer's log-probabilities are of logits / temperature; greedy has no density.
            raise ValueError(f"sampling.temperature must be > 0 for training, got "
                             f"{self.sampling.temperature}")
        if self.env == "mix" and not self.mix:
            raise ValueError("env: mix needs a non-empty mix list")
        if self.env != "mix" and self.mix:
            raise ValueError(f"mix is only read with env: mix (env is {self.env!r})")
        names = [m.name for m in self.mix_entries()]
        if len(set(names)) != len(names):
            raise ValueError(f"mix entries need distinct names (give each a name:), got {names}")
        for m in self.mix_entries():  # each entry's options were checked as it was built (MixEntry)
            if m.env == "shell":  # no jail here (not root, no cgroup): one line now, not at an episode
                from envs.sandbox import SandboxUnavailable, check_jail_support

                try:
                    check_jail_support(m.options.get("allow_unbounded_memory") is True,
                                       allow_unisolated=m.options.get("allow_unisolated") is True)
                except SandboxUnavailable as e:
                    raise ValueError(f"shell env: {e}") from None
        return self

    def mix_entries(self) -> list[MixEntry]:
        """The environments to draw tasks from (a single ``env`` is a mix of one)."""
        return list(self.mix) if self.env == "mix" else [MixEntry(env=self.env)]
