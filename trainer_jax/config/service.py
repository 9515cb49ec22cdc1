"""The rollout service's section (``service:``): listen address, TLS, buffer bounds, limits, router."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from mixrl_wire.token_file import check_token_file
from trainer_jax.config.base import Strict as _Strict
from trainer_jax.config.base import one_of


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
    # A reward, reward part or metric whose magnitude is above this (or that is not finite) is
    # out of range: a reward function's scores 0 as reward/errors/out_of_range, a Submit carrying
    # one is refused. float32 advantages of a group holding 3e38 come out NaN; at most 1e15, so
    # GRPO's squared deviations in float32 ((2e15)^2 x thousands of samples) cannot overflow.
    max_abs_reward: float = Field(1e6, gt=0, le=1e15, allow_inf_nan=False)


#: ``service.router.policy`` (``trainer_jax.service.router.POLICIES`` implements exactly these).
ROUTER_POLICIES = ("capacity", "cost", "throughput", "uniform")


class RouterConfig(_Strict):
    """How the lease budget is split across sampler groups (see trainer_jax.service.router)."""

    policy: str = "throughput"
    pin_groups: bool = True  # all G samples of a prompt go to one group (one lease)
    ema_alpha: float = Field(0.3, gt=0, le=1)
    interval_s: float = Field(1.0, gt=0)
    min_share: float = Field(0.05, ge=0, lt=1)
    # Constraints of policy cost (trainer_jax.service.router.cost_policy): no group above
    # max_share; a group whose probe KL (k3 of the version probe) or share of tokens outside
    # [c_min, c_max] is above its bound falls to min_share. None: no bound.
    max_share: float = Field(1.0, gt=0, le=1)
    max_k3: float | None = Field(None, ge=0, allow_inf_nan=False)
    max_out_of_range: float | None = Field(None, ge=0, le=1)

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        return one_of(v, ROUTER_POLICIES, "router policy")

    @model_validator(mode="after")
    def _share_bounds(self) -> RouterConfig:
        if self.max_share < self.min_share:
            raise ValueError(f"max_share ({self.max_share}) is below min_share ({self.min_share})")
        return self


class ProbeConfig(_Strict):
    """The version probe (``mixrl_wire.probe``, ``trainer_jax.service.probes``, docs/wire.md):
    at each publish the trainer samples ``tokens`` tokens after each of ``prompts`` fixed task
    prompts; every sampler scores them after loading and reports."""

    enabled: bool = True
    prompts: int = Field(4, gt=0, le=64)
    tokens: int = Field(16, gt=0, le=256)
    seed: int = 0
    # "serves the previous version" only when consecutive versions differ by more than this many
    # times the recipe's own noise (mean |delta log p| at equal weights); else "undecided".
    margin: float = Field(3.0, gt=0, allow_inf_nan=False)
    # What "above the bound" means. "run": probe KL above alarm_factor x the median of the
    # group's newest reports (at least baseline_versions of them; never below the table's bound),
    # a jump: a recipe's mismatch depends on the model, and a trained policy's sharper
    # distributions show far more than the table's tiny random policies. "table": the measured table
    # (trainer_jax/service/probe_bounds.json, benchmarks/bench_probe.py) as is.
    bounds: Literal["run", "table"] = "run"
    alarm_factor: float = Field(10.0, gt=1, allow_inf_nan=False)
    # Reports above the bound in a row before the alarm (a fault persists; one report's KL over
    # 64 tokens swings widely: on the demo's policy, 10x the recent median was crossed 4-14
    # times per group in 300 versions by single reports, never by 3 in a row).
    alarm_after: int = Field(3, ge=1)
    baseline_versions: int = Field(3, ge=1)
    # Stop leasing to a sampler whose probe exceeds its recipe's bound: with bounds: table only,
    # and only where the bound was measured on the sampler's device kind (elsewhere it alarms).
    enforce: bool = False
    # RELOAD requests after a no-op reload or stale weights before the session is revoked.
    max_reloads: int = Field(1, ge=0)


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
    probe: ProbeConfig = ProbeConfig()
    # `mixrl-train serve`: publish this directory as version 0 (an HF dir in `weights_format`, or
    # a directory of per-format HF dirs such as convert.publish writes).
    weights_dir: str | None = None
    weights_format: str = "bf16"
    vocab_size: int | None = Field(None, gt=0)  # default: weights' config.json, else the tokenizer

    @field_validator("token_file")
    @classmethod
    def _small_regular_file(cls, v: str | None) -> str | None:
        # stat only: /dev/zero, a FIFO, a directory or a huge file is one line here, before the run
        # directory is touched; a missing file is fine (mixrl-train writes a new token there).
        if v is not None:
            check_token_file(v)
        return v

    @model_validator(mode="after")
    def _listen_and_ttls(self) -> ServiceConfig:
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise ValueError(f"listen must be HOST:PORT, got {self.listen!r}")
        if self.heartbeat_s >= self.session_ttl_s:
            raise ValueError(f"heartbeat_s ({self.heartbeat_s}) must be below session_ttl_s "
                             f"({self.session_ttl_s})")
        return self
