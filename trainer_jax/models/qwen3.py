"""Qwen3 and Qwen3-MoE decoder in flax.nnx, numerically matching transformers' definitions.

Shapes: B batch, T time, D hidden, H query heads, K key/value heads, G = H / K, E experts.
Linear kernels are stored ``[in, out]`` (the HF ``[out, in]`` transpose); the name mapping to HF
checkpoints lives in ``hf_params.py``.

Packing: several sequences may share one row. ``segment_ids`` (0 = padding) keep attention inside
a sequence and ``positions`` restart at each segment (derived from the segment ids if omitted).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from convert.qwen3_config import Qwen3Config
from trainer_jax.models import capture  # no-ops unless calibrating (trainer_jax.calibration)
from trainer_jax.models.attention import attention
from trainer_jax.models.grouped_matmul import GroupedRows, group_rows
from trainer_jax.models.remat import check_remat, run_layers
from trainer_jax.parallel import hooks  # no-ops unless a device mesh is active (docs/scale_out.md)

Array = jax.Array


class RMSNorm(nnx.Module):
    """``w * x / sqrt(mean(x^2) + eps)``, normalised in fp32 then cast back, as transformers does."""

    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: Array) -> Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight.get_value().astype(x.dtype) * normed.astype(x.dtype)


class Linear(nnx.Linear):
    """``nnx.Linear`` run as one 2-D matmul over the flattened leading axes.

    Written over ``[B, T, D]`` directly, the backward's weight gradient contracts two axes, and
    XLA:CPU lays it out with a transposed copy of the output gradient before the matmul; over
    ``[B*T, D]`` it is a plain ``x^T dy`` (bench_forward's MLP, fwd+bwd on 2,048 rows: 83 -> 65 ms
    on the 2-core CPU host). The batch axis stays major, so a data/FSDP sharding of it carries
    over to the merged axis.
    """

    def __call__(self, x: Array) -> Array:
        if hooks.override("sequence_layout") is not None:
            # Context parallelism splits both B and T: [B*T] has no block layout, and merging
            # them would all-gather the sequence (parallel/sequence.py).
            return super().__call__(x)
        return super().__call__(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], self.out_features)


def _linear(din: int, dout: int, dtype, param_dtype, rngs: nnx.Rngs) -> Linear:
    return Linear(din, dout, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                  kernel_init=nnx.initializers.normal(0.02), rngs=rngs)


def rope_cos_sin(positions: Array, head_dim: int, theta: float) -> tuple[Array, Array]:
    """Rotary tables ``[B, T, head_dim]`` with the half-split (rotate_half) layout of HF."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate ``x [B, T, heads, hd]``; computed in fp32 for parity at any compute dtype."""
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


def segment_positions(segment_ids: Array) -> Array:
    """Positions restarting at 0 at every change of segment id along T."""
    t = jnp.arange(segment_ids.shape[-1])
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], -1)
    first = jax.lax.cummax(jnp.where(starts, t, 0), axis=1)
    return (t - first).astype(jnp.int32)


class Attention(nnx.Module):
    def __init__(self, cfg: Qwen3Config, *, dtype, param_dtype, rngs: nnx.Rngs,
                 attention_impl: str | None = None):
        d, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, hd)
        self.rope_theta = cfg.rope_theta
        self.attention_impl = attention_impl
        self.q_proj = _linear(d, self.num_heads * hd, dtype, param_dtype, rngs)
        self.k_proj = _linear(d, self.num_kv_heads * hd, dtype, param_dtype, rngs)
        self.v_proj = _linear(d, self.num_kv_heads * hd, dtype, param_dtype, rngs)
        self.o_proj = _linear(self.num_heads * hd, d, dtype, param_dtype, rngs)
        # Qwen3: RMSNorm over each head's features, before RoPE.
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, param_dtype=param_dtype)

    def __call__(self, x: Array, positions: Array, segment_ids: Array) -> Array:
        b, t, _ = x.shape
        k_heads, hd = self.num_kv_heads, self.head_dim
        capture.amax("self_attn.qkv", x)
        q = self.q_norm(self.q_proj(x).reshape(b, t, self.num_heads, hd))
        k = self.k_norm(self.k_proj(x).reshape(b, t, k_heads, hd))
        v = self.v_proj(x).reshape(b, t, k_heads, hd)
        q = hooks.constrain(q, ("batch", "seq", "heads", None))
        k = hooks.constrain(k, ("batch", "seq", "kv_heads", None))
        v = hooks.constrain(v, ("batch", "seq", "kv_heads", None))
        cos, sin = rope_cos_sin(positions, hd, self.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        capture.amax("self_attn.k", k)  # what a KV cache stores: K after norm and RoPE, and V
        capture.amax("self_attn.v", v)
        attend = hooks.override("attention") or attention  # on a mesh: per device, no gathers
        out = attend(q, k, v, segment_ids, impl=self.attention_impl).reshape(b, t, self.num_heads * hd)
        capture.amax("self_attn.o", out)
        return self.o_proj(out)


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, d: int, f: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.gate_proj = _linear(d, f, dtype, param_dtype, rngs)
        self.up_proj = _linear(d, f, dtype, param_dtype, rngs)
        self.down_proj = _linear(f, d, dtype, param_dtype, rngs)

    def __call__(self, x: Array) -> Array:
        capture.amax("mlp.gate_up", x)
        hidden = hooks.constrain(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x), ("batch", "seq", "mlp"))
        capture.amax("mlp.down", hidden)
        return self.down_proj(hidden)


class MoE(nnx.Module):
    """Softmax router over E experts, top-k, optional renormalisation of the k weights.

    Experts run as grouped matmuls on one grouping (``grouped_matmul.group_rows``: ``ragged_dot`` on
    accelerators, batched matmuls of expert-padded row blocks on CPU) over token copies sorted by
    expert, so each expert sees only its tokens and there is no Python loop over experts.
    """

    def __init__(self, cfg: Qwen3Config, *, dtype, param_dtype, rngs: nnx.Rngs,
                 moe_impl: str | None = None):
        d, f, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        self.num_experts, self.top_k, self.norm_topk_prob = (
            e, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        self.dtype = dtype
        self.moe_impl = moe_impl
        self.gate = _linear(d, e, dtype, param_dtype, rngs)  # the router, [D, E]
        init = nnx.initializers.normal(0.02)
        self.gate_proj = nnx.Param(init(rngs.params(), (e, d, f), param_dtype))
        self.up_proj = nnx.Param(init(rngs.params(), (e, d, f), param_dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (e, f, d), param_dtype))

    def route(self, tokens: Array) -> tuple[Array, Array]:
        """Top-k combine weights ``[N, k]`` (in the tokens' dtype) and expert ids ``[N, k]``."""
        logits = self.gate(tokens)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        weights, experts = jax.lax.top_k(probs, self.top_k)  # [N, k]
        if self.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights.astype(tokens.dtype), experts  # transformers casts back before the sum

    def expert_ffn(self, tokens: Array, rows: GroupedRows) -> Array:
        """SwiGLU of the top-k copies of ``tokens [N, D]``, copy ``i`` (token ``i // k``) by the
        expert of row ``i`` of ``rows``, in ``rows``' packed layout (``rows.unpack`` for the
        copies in order; zeros for copies of no expert)."""
        weight = lambda param: param.get_value().astype(self.dtype)
        packed = rows.pack(tokens.astype(self.dtype), copies=self.top_k)  # once for the 3 matmuls
        # Padding rows of the packed layout are zeros, so they leave each expert's maximum alone.
        capture.grouped_amax("mlp.experts.gate_up", rows.rows(packed), rows.packed_sizes)
        gate, up = rows.matmul_pair(packed, weight(self.gate_proj), weight(self.up_proj))
        hidden = jax.nn.silu(gate.astype(self.dtype)) * up.astype(self.dtype)  # as transformers rounds
        capture.grouped_amax("mlp.experts.down", rows.rows(hidden), rows.packed_sizes)
        return rows.matmul(hidden, weight(self.down_proj)).astype(self.dtype)

    def __call__(self, x: Array) -> Array:
        if (dispatch := hooks.override("moe")) is not None:  # expert-parallel on a device mesh
            return dispatch(self, x)
        b, t, d = x.shape
        tokens = x.reshape(b * t, d)
        weights, experts = self.route(tokens)
        rows = group_rows(experts.reshape(-1), self.num_experts, impl=self.moe_impl)
        out = rows.unpack_combine(self.expert_ffn(tokens, rows), weights)
        return out.astype(x.dtype).reshape(b, t, d)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: Qwen3Config, layer: int, *, dtype, param_dtype, rngs: nnx.Rngs,
                 moe_impl: str | None = None, attention_impl: str | None = None):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.self_attn = Attention(cfg, **kw, attention_impl=attention_impl)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                param_dtype=param_dtype)
        self.mlp = (MoE(cfg, **kw, moe_impl=moe_impl) if cfg.layer_is_sparse(layer)
                    else MLP(cfg.hidden_size, cfg.intermediate_size, **kw))

    def __call__(self, x: Array, positions: Array, segment_ids: Array) -> Array:
        x = x + self.self_attn(self.input_layernorm(x), positions, segment_ids)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3(nnx.Module):
    """Qwen3 / Qwen3-MoE causal LM. ``model(input_ids)`` returns logits ``[B, T, V]`` (fp32).

    ``dtype`` is the compute dtype, ``param_dtype`` the stored one (bf16 compute over fp32
    parameters: ``dtype=bfloat16, param_dtype=float32``). ``attention_impl`` names an
    ``attention.IMPLS`` entry (``None``/``"auto"``: per platform); ``remat`` is ``"none"``,
    ``"full"`` or a ``jax.checkpoint_policies`` name, applied per decoder layer (``remat.py``: with
    remat on, runs of same-structure layers are scanned).
    """

    def __init__(self, cfg: Qwen3Config, *, dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs: nnx.Rngs | None = None, moe_impl: str | None = None,
                 attention_impl: str | None = None, remat: str = "none"):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = cfg
        self.dtype = dtype
        self.remat = remat
        check_remat(remat)  # an unknown name fails here, not at the first step
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                                      param_dtype=param_dtype,
                                      embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.layers = nnx.List([
            DecoderLayer(cfg, i, dtype=dtype, param_dtype=param_dtype, rngs=rngs, moe_impl=moe_impl,
                         attention_impl=attention_impl)
            for i in range(cfg.num_hidden_layers)
        ])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else _linear(cfg.hidden_size, cfg.vocab_size, dtype, param_dtype, rngs))

    def lm_head_weight(self) -> Array:
        """The output projection as ``[D, V]`` (the transposed embedding when tied)."""
        if self.lm_head is None:
            return self.embed_tokens.embedding.get_value().T
        return self.lm_head.kernel.get_value()

    def hidden_states(self, input_ids: Array, *, positions: Array | None = None,
                      segment_ids: Array | None = None) -> Array:
        """Final-norm hidden states ``[B, T, D]``: what the fused LM-head loss consumes."""
        input_ids = jnp.asarray(input_ids, jnp.int32)
        b, t = input_ids.shape
        if segment_ids is None:
            segment_ids = jnp.ones((b, t), jnp.int32)
        if positions is None:
            positions = segment_positions(segment_ids)
        residual = lambda x: hooks.constrain(x, ("batch", "seq", "act_embed"))
        if (lookup := hooks.override("embed")) is not None:  # sharded table on a device mesh
            x = lookup(self.embed_tokens.embedding.get_value().astype(self.dtype), input_ids)
        else:
            x = self.embed_tokens(input_ids)
        x = residual(x)
        x = run_layers(list(self.layers), x, positions, segment_ids, self.remat, residual)
        return self.norm(x)

    def __call__(self, input_ids: Array, *, positions: Array | None = None,
                 segment_ids: Array | None = None) -> Array:
        h = self.hidden_states(input_ids, positions=positions, segment_ids=segment_ids)
        w = self.lm_head_weight().astype(self.dtype)
        b, t, d = h.shape  # one 2-D matmul, for the reason ``Linear`` gives
        return jnp.dot(h.reshape(b * t, d), w, preferred_element_type=jnp.float32).reshape(b, t, -1)
