"""The Qwen3 / Qwen3-MoE architecture config, read from and written to HF ``config.json``.

Framework-free so the JAX trainer, the PyTorch sampler and the converter share one definition.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

DENSE_TYPE = "qwen3"
MOE_TYPE = "qwen3_moe"
_ARCHITECTURES = {DENSE_TYPE: "Qwen3ForCausalLM", MOE_TYPE: "Qwen3MoeForCausalLM"}


class ConfigError(ValueError):
    """A model config is inconsistent or asks for something this implementation lacks."""


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40_960
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    # Mixture of experts (Qwen3-MoE); num_experts == 0 means dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Keys of config.json we do not interpret (token ids, dtype, ...), kept for the round trip.
    extra: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act={self.hidden_act!r}: only 'silu' (SwiGLU) is supported")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(
                    f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                    f"[1, num_experts={self.num_experts}]"
                )
            if self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0:
                raise ConfigError("MoE needs moe_intermediate_size > 0 and decoder_sparse_step > 0")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def model_type(self) -> str:
        return MOE_TYPE if self.is_moe else DENSE_TYPE

    def layer_is_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` uses the expert block (transformers' rule)."""
        return (
            self.is_moe
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Qwen3Config:
        model_type = d.get("model_type", DENSE_TYPE)
        if model_type not in _ARCHITECTURES:
            raise ConfigError(f"model_type={model_type!r}: expected one of {list(_ARCHITECTURES)}")
        rope_theta = d.get("rope_theta")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if rope:
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type != "default":
                raise ConfigError(f"rope_type={rope_type!r}: only default RoPE is implemented")
            rope_theta = rope.get("rope_theta", rope_theta)
        try:
            heads = int(d["num_attention_heads"])
            kwargs = dict(
                vocab_size=int(d["vocab_size"]),
                hidden_size=int(d["hidden_size"]),
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
            )
        except KeyError as e:
            raise ConfigError(f"config.json lacks required key {e.args[0]!r}") from None
        for key, cast in (("rms_norm_eps", float), ("max_position_embeddings", int),
                          ("tie_word_embeddings", bool), ("hidden_act", str)):
            if d.get(key) is not None:
                kwargs[key] = cast(d[key])
        if rope_theta is not None:
            kwargs["rope_theta"] = float(rope_theta)
        if model_type == MOE_TYPE:
            num_experts = d.get("num_experts", d.get("num_local_experts"))
            kwargs.update(
                num_experts=int(num_experts or 0),
                num_experts_per_tok=int(d.get("num_experts_per_tok", 0)),
                moe_intermediate_size=int(d.get("moe_intermediate_size", 0)),
                norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                decoder_sparse_step=int(d.get("decoder_sparse_step", 1)),
                mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()),
            )
            if kwargs["num_experts"] == 0:
                raise ConfigError("model_type qwen3_moe with num_experts = 0")
        if d.get("attention_bias"):
            raise ConfigError("attention_bias=true is not supported (Qwen3 has no attention bias)")
        known = set(kwargs) | {"model_type", "architectures", "rope_parameters", "rope_scaling",
                               "num_local_experts", "attention_bias"}
        kwargs["extra"] = {k: v for k, v in d.items() if k not in known}
        return cls(**kwargs)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> Qwen3Config:
        p = Path(path)
        p = p / "config.json" if p.is_dir() else p
        try:
            return cls.from_hf_dict(json.loads(p.read_text()))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p} is not valid JSON ({e})") from None

    def to_hf_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = dict(self.extra)
        d.update(
            model_type=self.model_type,
            architectures=[_ARCHITECTURES[self.model_type]],
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            # Both spellings: transformers >= 5 reads rope_parameters, older versions rope_theta.
            rope_theta=self.rope_theta,
            rope_parameters={"rope_theta": self.rope_theta, "rope_type": "default"},
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            hidden_act=self.hidden_act,
            attention_bias=False,
        )
        if self.is_moe:
            d.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
            )
        return d


def hf_tensor_shapes(cfg: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF Qwen3 / Qwen3-MoE checkpoint of this config holds, with its shape.

    Linear weights are ``[out, in]`` as in ``torch.nn.Linear``; MoE experts are stored one tensor
    per expert and projection (``mlp.experts.{e}.{gate,up,down}_proj.weight``).
    """
    d, hd = cfg.hidden_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, d)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.input_layernorm.weight": (d,),
            f"{p}.post_attention_layernorm.weight": (d,),
            f"{p}.self_attn.q_proj.weight": (cfg.num_attention_heads * hd, d),
            f"{p}.self_attn.k_proj.weight": (cfg.num_key_value_heads * hd, d),
            f"{p}.self_attn.v_proj.weight": (cfg.num_key_value_heads * hd, d),
            f"{p}.self_attn.o_proj.weight": (d, cfg.num_attention_heads * hd),
            f"{p}.self_attn.q_norm.weight": (hd,),
            f"{p}.self_attn.k_norm.weight": (hd,),
        })
        if cfg.layer_is_sparse(i):
            f = cfg.moe_intermediate_size
            shapes[f"{p}.mlp.gate.weight"] = (cfg.num_experts, d)
            for e in range(cfg.num_experts):
                shapes.update({
                    f"{p}.mlp.experts.{e}.gate_proj.weight": (f, d),
                    f"{p}.mlp.experts.{e}.up_proj.weight": (f, d),
                    f"{p}.mlp.experts.{e}.down_proj.weight": (d, f),
                })
        else:
            f = cfg.intermediate_size
            shapes.update({
                f"{p}.mlp.gate_proj.weight": (f, d),
                f"{p}.mlp.up_proj.weight": (f, d),
                f"{p}.mlp.down_proj.weight": (d, f),
            })
    shapes["model.norm.weight"] = (d,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    return shapes
