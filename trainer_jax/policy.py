"""The policy a run config describes: its architecture and its parameters, created on a mesh."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from convert.qwen3_config import Qwen3Config
from trainer_jax.config import ConfigError, RunConfig
from trainer_jax.models import Qwen3
from trainer_jax.models.attention import check_platform
from trainer_jax.parallel.mesh import make_mesh
from trainer_jax.parallel.rules import ShardingRules
from trainer_jax.parallel.sharding import init_sharded_model, load_hf_sharded

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def model_config(cfg: RunConfig, vocab_size: int, special_ids: dict[str, int] | None = None) -> Qwen3Config:
    """The policy's architecture: the HF directory's config, or the tiny random Qwen3 of ``model:``.

    ``special_ids`` (``{"bos", "eos", "pad"}`` -> id, from the tokenizer) go into a new model's
    config, so the published checkpoints name the tokens the tokenizer actually uses.
    """
    m = cfg.model
    if m.hf_dir:
        return Qwen3Config.from_pretrained(m.hf_dir)
    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads, head_dim=m.head_dim,
        tie_word_embeddings=m.tie_word_embeddings, num_experts=m.num_experts,
        num_experts_per_tok=m.num_experts_per_tok, moe_intermediate_size=m.moe_intermediate_size,
        extra={f"{k}_token_id": v for k, v in (special_ids or {}).items()})


def check_layout(cfg: RunConfig, mesh: Mesh) -> None:
    """The run's batches and kernels against the mesh, before anything is built (``ConfigError``).

    Rows are split over the ``batch`` axes (data, fsdp, expert) in whole rows, and each
    micro-batch is too: a count the shards do not divide would leave the batch whole on every
    device (every device computing every row), so it is an error rather than a slow run.
    """
    rules = ShardingRules.for_model(None, cfg.mesh.rules)
    shards = math.prod(mesh.shape[a] for a in rules.logical["batch"])
    split = " x ".join(f"{a} {mesh.shape[a]}" for a in rules.logical["batch"])
    for key, rows in (("train.rows", cfg.train.rows), ("train.micro_rows", cfg.train.micro_rows),
                      ("sft.rows", cfg.sft.rows if cfg.sft.steps else None)):
        if rows is not None and rows % shards:
            raise ConfigError(f"{key} ({rows}) must be a multiple of the mesh's batch shards "
                              f"({split} = {shards}): every device takes whole rows")
    try:
        check_platform(cfg.model.attention, mesh.devices.flat[0].platform)
    except ValueError as e:
        raise ConfigError(f"model.attention: {e}") from None


def build_policy(cfg: RunConfig, vocab_size: int, special_ids: dict[str, int] | None = None,
                 mesh: Mesh | None = None, *, load_weights: bool = True) -> tuple[Qwen3, Qwen3Config]:
    """The initial policy, created on ``mesh`` (default: one device) and never whole elsewhere:
    an HF checkpoint if configured, else a tiny random Qwen3 (see ``model_config``), with the run's
    compute dtype, attention and remat. ``load_weights=False``: random weights even with
    ``model.hf_dir`` (its architecture only; the scale-out smoke check)."""
    mesh = mesh if mesh is not None else make_mesh(devices=jax.devices()[:1])
    qcfg = model_config(cfg, vocab_size, special_ids)
    rules = ShardingRules.for_model(qcfg, cfg.mesh.rules)
    dtype = DTYPES[cfg.model.dtype]
    attention = cfg.model.attention
    if cfg.model.hf_dir and load_weights:
        model, qcfg = load_hf_sharded(cfg.model.hf_dir, mesh, rules, dtype=dtype,
                                      param_dtype=jnp.float32, attention_impl=attention)
    else:
        model = init_sharded_model(qcfg, mesh, rules, seed=cfg.model.seed, dtype=dtype,
                                   param_dtype=jnp.float32, attention_impl=attention)
    model.remat = cfg.train.remat  # read when the step is traced (trainer_jax.models.remat)
    return model, qcfg
