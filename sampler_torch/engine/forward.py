"""The engine's forward pass over a recipe-loaded ``Qwen3ForCausalLM``: the same math as the
model's own ``forward``, arranged for decode throughput.

- The projections of one input are fused when they are plain ``nn.Linear`` (bf16 recipes):
  ``[q; k; v]`` and ``[gate; up]`` run as one matmul each (the outputs are the same numbers:
  a fused GEMM computes each output column exactly as the separate one does). Quantized
  projections (``QuantLinear``) and MoE blocks are called as modules, so every recipe keeps its
  own kernels.
- Matmul kernel for bf16 weights: on CPU, ``kernel="auto"`` multiplies the bf16 operands with the
  float32 GEMM (weights upcast once at load) and rounds the output to bf16. That is exactly the
  arithmetic of a bf16 tensor-core GEMM -- bf16 x bf16 products are exact in float32,
  accumulation in float32, output rounded to bf16 -- and this CPU's sgemm runs it about 1.7x
  faster than its bf16 GEMM path. ``kernel="native"`` uses the bf16 GEMM.
- RoPE tables and the attention mask are built once per forward, not once per layer; KV-cache
  reads of a contiguous run of slots are views, not gathers.

Everything else (RMSNorm in float32 then cast, RoPE in float32, softmax in float32 for the
explicit attention, the float32 logits) follows ``sampler_torch.models.qwen3``;
``tests/sampler/test_engine_forward.py`` holds the two equal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sampler_torch.models import KVCache, Qwen3ForCausalLM
from sampler_torch.models.qwen3 import MLP, rope_cos_sin
from sampler_torch.recipes import Recipe


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))`` with the normalisation in float32, as ``models.qwen3.RMSNorm``."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rotate_half RoPE of ``x [B, heads, T, hd]`` with ``cos/sin [B, 1, T, hd]``, in float32."""
    half = x.shape[-1] // 2
    x32 = x.float()
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


class _Proj:
    """One (possibly fused) projection: a weight for ``F.linear`` or the recipe's module(s)."""

    def __init__(self, modules: list[nn.Module], mm_dtype: torch.dtype):
        self.sizes = [m.out_features for m in modules]
        if all(type(m) is nn.Linear for m in modules):
            self.weight = torch.cat([m.weight.detach() for m in modules]).to(mm_dtype)
            self.modules = None
        else:
            self.weight = None
            self.modules = modules

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.weight is None:
            return [m(x) for m in self.modules]
        y = F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)
        return list(y.split(self.sizes, dim=-1)) if len(self.sizes) > 1 else [y]


class EngineForward:
    """``forward(ids [B, T], positions [B, T], cache, slots) -> final hidden states [B, T, D]``
    and ``logits(hidden) -> float32``; built once per loaded weights version."""

    def __init__(self, model: Qwen3ForCausalLM, recipe: Recipe):
        self.model = model
        cfg = self.config = model.config
        self.dtype = recipe.torch_dtype
        device = model.lm_head.weight.device
        use_sgemm = (self.dtype == torch.bfloat16 and device.type == "cpu"
                     and recipe.kernel in ("auto", "emulate"))
        mm = torch.float32 if use_sgemm else self.dtype
        self.eps = cfg.rms_norm_eps
        self.heads, self.kv_heads, self.head_dim = (cfg.num_attention_heads,
                                                    cfg.num_key_value_heads, cfg.head_dim)
        self.attention = recipe.attention
        self.layers = []
        for layer in model.model.layers:
            attn = layer.self_attn
            mlp = layer.mlp
            dense = isinstance(mlp, MLP)
            self.layers.append(dict(
                ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
                q_norm=attn.q_norm.weight, k_norm=attn.k_norm.weight,
                qkv=_Proj([attn.q_proj, attn.k_proj, attn.v_proj], mm),
                o=_Proj([attn.o_proj], mm),
                gate_up=_Proj([mlp.gate_proj, mlp.up_proj], mm) if dense else None,
                down=_Proj([mlp.down_proj], mm) if dense else None,
                moe=None if dense else mlp))
        self.final_norm = model.model.norm.weight
        self.embed = model.model.embed_tokens
        self.lm_head = _Proj([model.lm_head], mm)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor a forward reads that this object owns (fused weights) or borrows."""
        out = [p for p in self.model.parameters()] + [b for b in self.model.buffers()]
        for lyr in self.layers:
            out += [p.weight for p in (lyr["qkv"], lyr["o"], lyr["gate_up"], lyr["down"])
                    if p is not None and p.weight is not None]
        if self.lm_head.weight is not None:
            out.append(self.lm_head.weight)
        return out

    def _attend(self, q, k, v, mask):
        groups = self.heads // self.kv_heads
        if self.attention == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=groups > 1)
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        scores = (q.float() @ k.float().transpose(-1, -2)) * self.head_dim ** -0.5
        scores = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
        return scores.softmax(-1).to(v.dtype) @ v

    @torch.inference_mode()
    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
               cache: KVCache | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
        """Final-norm hidden states; with a cache, rows ``slots`` at ``positions`` (default 0..T-1).

        Keys at positions past a query's own are masked, so padding and stale cache entries are
        never attended (``sampler_torch.models.kv_cache``).
        """
        b, t = input_ids.shape
        dev = input_ids.device
        if positions is None:
            positions = torch.arange(t, device=dev).expand(b, t)
        hd, nh, nk = self.head_dim, self.heads, self.kv_heads
        cos, sin = rope_cos_sin(positions, hd, self.config.rope_theta)
        cos, sin = cos[:, None], sin[:, None]
        read_slots: torch.Tensor | slice | None = slots
        if cache is None:
            key_pos = positions
        else:
            length = int(positions.max()) + 1
            key_pos = torch.arange(length, device=dev).expand(b, length)
            first = int(slots[0])
            if b == 1 or bool((slots == torch.arange(first, first + b, device=dev)).all()):
                read_slots = slice(first, first + b)  # a view instead of a gather
        mask = key_pos[:, None, None, :] <= positions[:, None, :, None]
        x = self.embed(input_ids)
        for i, lyr in enumerate(self.layers):
            h = _rms(x, lyr["ln1"], self.eps)
            q, k, v = lyr["qkv"](h)
            q = _rms(q.view(b, t, nh, hd), lyr["q_norm"], self.eps).transpose(1, 2)
            k = _rms(k.view(b, t, nk, hd), lyr["k_norm"], self.eps).transpose(1, 2)
            v = v.view(b, t, nk, hd).transpose(1, 2)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            if cache is not None:
                cache.write(i, slots, positions, k, v)
                k, v = cache.read(i, read_slots, length, q.dtype)
            out = self._attend(q, k, v, mask)
            x = x + lyr["o"](out.transpose(1, 2).reshape(b, t, nh * hd))[0]
            h = _rms(x, lyr["ln2"], self.eps)
            if lyr["moe"] is not None:
                x = x + lyr["moe"](h)
            else:
                gate, up = lyr["gate_up"](h)
                x = x + lyr["down"](F.silu(gate) * up)[0]
        return _rms(x, self.final_norm, self.eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)[0].float()
