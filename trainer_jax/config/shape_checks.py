"""Checks across a config's sections that ``load_config`` runs on every config (they read no files):
kept sets against the learner's columns, rows against the wire's limits, rows against context
parallelism. Each problem is a ``ConfigError`` of one line naming the keys.

They take the sections they read (``Sections``: ``RunConfig`` is one), so the root config imports
this module and nothing here imports it back.
"""

from __future__ import annotations

from typing import Protocol

from trainer_jax.config.base import ConfigError
from trainer_jax.config.learning import ObjectiveConfig, SFTConfig
from trainer_jax.config.parallel import MeshConfig
from trainer_jax.config.run import TasksConfig, TrainConfig
from trainer_jax.config.service import ServiceConfig


class Sections(Protocol):
    """The sections of a run config these checks read."""

    tasks: TasksConfig
    train: TrainConfig
    objective: ObjectiveConfig
    service: ServiceConfig
    mesh: MeshConfig
    sft: SFTConfig


def check_kept_sets(cfg: Sections) -> None:
    """Every kept set a sampler records must fit the learner's ``train.support_k`` columns.

    Top-p alone bounds a kept set by nothing but the vocabulary, so ``tasks.sampling.top_p < 1``
    with ``objective.top_p_replay`` needs ``0 < tasks.sampling.top_k <= train.support_k`` (SGLang
    also returns a kept set only with a finite top-k); a top-k above ``train.support_k`` would have
    every truncated sample refused. Evaluation samples with ``tasks.sampling`` too. A set that
    still does not fit is refused at submission (``trainer_jax.service.validation``). Raises
    ``ConfigError`` naming the keys.
    """
    s, k = cfg.tasks.sampling, cfg.train.support_k
    if s.top_p < 1 and cfg.objective.top_p_replay and not 0 < s.top_k <= k:
        raise ConfigError(f"tasks.sampling.top_p {s.top_p} < 1 with objective.top_p_replay needs "
                          f"0 < tasks.sampling.top_k <= train.support_k ({k}), got top_k {s.top_k}: "
                          "top-p alone does not bound the kept set")
    if s.top_k > k:
        raise ConfigError(f"tasks.sampling.top_k {s.top_k} > train.support_k {k}: every kept set "
                          "of top_k ids would be refused; raise train.support_k or lower top_k")


def trajectory_wire_bytes(tokens: int, head_k: int, support_k: int) -> int:
    """An upper bound of one trajectory's serialized size when every one of its ``tokens`` is a
    policy token with a full support set: per token the id, mask, two log-probs, version and
    support offset (21 bytes) plus ``head_k`` and ``support_k`` (id, log-prob) pairs (``support_k``
    0 when the sampling does not truncate); 1 KiB of tags and scalars
    (``mixrl_wire.encoder.size_bound``). head_k 20, support_k 64: 693 bytes per token."""
    return 1024 + tokens * (21 + 8 * head_k + 8 * support_k)


def check_wire_limits(cfg: Sections) -> None:
    """A trajectory that fills one row must pass the wire: ``train.row_len`` against
    ``service.limits.max_trajectory_tokens`` and ``max_message_bytes`` (at the bound above).

    Long rows (context parallelism) need the limits raised in the config; the error names the
    values and what they cost: the service holds each accepted trajectory's arrays until its step
    takes it, and gRPC holds a message whole while it arrives.
    """
    limits, row_len, sampling = cfg.service.limits, cfg.train.row_len, cfg.tasks.sampling
    truncates = sampling.top_p < 1 or sampling.top_k > 0  # else no support sets are sent
    head_k, support_k = sampling.head_k, cfg.train.support_k if truncates else 0
    need = trajectory_wire_bytes(row_len, head_k, support_k)
    if row_len > limits.max_trajectory_tokens:
        raise ConfigError(f"train.row_len {row_len} > service.limits.max_trajectory_tokens "
                          f"{limits.max_trajectory_tokens}: trajectories that fill a row would be "
                          f"refused; set service.limits.max_trajectory_tokens: {row_len} and "
                          f"max_message_bytes >= {need} ({need / 2**20:.0f} MiB per trajectory "
                          f"at head_k {head_k}, support_k {support_k}, held in the service's memory)")
    if need > limits.max_message_bytes:
        raise ConfigError(f"service.limits.max_message_bytes {limits.max_message_bytes} < {need}: a "
                          f"trajectory of train.row_len {row_len} tokens (head_k {head_k}, support_k "
                          f"{support_k}: {need // row_len} bytes per token) would be refused; raise it "
                          f"({need / 2**20:.0f} MiB per trajectory, held in the service's memory)")


def check_context_rows(cfg: Sections) -> None:
    """With ``mesh.context`` > 1 every row is cut into 2 x context zigzag chunks
    (``trainer_jax.parallel.sequence``): ``train.row_len`` and ``sft.row_len`` must divide."""
    context = cfg.mesh.context
    for key, row_len in (("train.row_len", cfg.train.row_len),
                         ("sft.row_len", cfg.sft.row_len if cfg.sft.steps else None)):
        if context > 1 and row_len is not None and row_len % (2 * context):
            raise ConfigError(f"{key} {row_len} is not a multiple of 2 x mesh.context = {2 * context} "
                              "(context parallelism cuts every row into 2 x context chunks)")


__all__ = ["Sections", "check_context_rows", "check_kept_sets", "check_wire_limits", "trajectory_wire_bytes"]
