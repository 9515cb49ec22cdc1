"""Qwen3 / Qwen3-MoE in PyTorch for the sampler, with a slot-addressed KV cache.

Module names equal HF checkpoint names (``model.layers.{i}.self_attn.q_proj`` ...), so a state
dict key is an HF tensor name and a precision recipe can swap any ``nn.Linear`` by that name
(quantized weights, quantized activations). Every projection is its own ``nn.Linear`` for that
reason: no fused QKV, experts as a ``ModuleList`` of per-expert MLPs like the HF files.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from convert.qwen3_config import Qwen3Config
from sampler_torch.models.kv_cache import KVCache

ATTENTION_IMPLS = ("sdpa", "eager")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                             device=positions.device) / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, heads, T, hd]`` with tables ``[B, T, hd]`` (rotate_half layout)."""
    half = x.shape[-1] // 2
    x32 = x.float()
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config, layer: int):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, hd)
        self.rope_theta = cfg.rope_theta
        self.q_proj = nn.Linear(d, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.impl = "sdpa"

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache | None,
                slots: torch.Tensor | None) -> torch.Tensor:
        b, t, _ = x.shape
        hd = self.head_dim
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, hd)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, hd).transpose(1, 2)
        cos, sin = rope_cos_sin(positions, hd, self.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:
            key_pos = positions
        else:
            cache.write(self.layer, slots, positions, k, v)
            length = int(positions.max()) + 1
            k, v = cache.read(self.layer, slots, length, q.dtype)
            key_pos = torch.arange(length, device=x.device).expand(b, length)
        # A query at position p sees keys at positions <= p of its own row.
        mask = key_pos[:, None, None, :] <= positions[:, None, :, None]  # [B, 1, T, S]
        out = self._attend(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * hd))

    def _attend(self, q, k, v, mask):
        groups = self.num_heads // self.num_kv_heads
        if self.impl == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=groups > 1)
        if self.impl != "eager":
            raise ValueError(f"attention impl {self.impl!r}: expected one of {ATTENTION_IMPLS}")
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        scores = (q.float() @ k.float().transpose(-1, -2)) * self.head_dim ** -0.5
        scores = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
        return (scores.softmax(-1).to(v.dtype) @ v)


class MLP(nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Softmax router, top-k, optional renormalisation; each hit expert runs on its tokens only."""

    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        logits = self.gate(tokens)
        weights, chosen = torch.topk(logits.float().softmax(-1), self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(tokens)
        for e in chosen.unique().tolist():
            token_idx, slot = torch.where(chosen == e)
            y = self.experts[e](tokens[token_idx]) * weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out.view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.layer_is_sparse(layer) else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, positions, cache, slots):
        x = x + self.self_attn(self.input_layernorm(x), positions, cache, slots)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    """``model(input_ids [B, T])`` -> logits ``[B, T, V]`` in float32.

    With a ``cache``: ``slots [B]`` names each row's cache slot and ``positions [B, T]`` the
    absolute position of each token (default ``0..T-1``, i.e. a prefill from the start).
    """

    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.config = cfg
        self.model = Qwen3Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def set_attention_impl(self, impl: str) -> None:
        if impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention impl {impl!r}: expected one of {ATTENTION_IMPLS}")
        for layer in self.model.layers:
            layer.self_attn.impl = impl

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                      cache: KVCache | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
        b, t = input_ids.shape
        if positions is None:
            positions = torch.arange(t, device=input_ids.device).expand(b, t)
        if cache is not None and slots is None:
            slots = torch.arange(b, device=input_ids.device)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, cache, slots)
        return self.model.norm(x)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: KVCache | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(self.hidden_states(input_ids, positions, cache, slots)).float()
