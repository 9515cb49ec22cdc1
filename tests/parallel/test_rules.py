"""Partitioning rules and mesh shapes, without devices (abstract meshes; this process has one CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P
from tiny_models import ALL_CONFIGS

from convert.qwen3_config import Qwen3Config
from trainer_jax.config import MeshConfig
from trainer_jax.models import init_model
from trainer_jax.parallel import hooks
from trainer_jax.parallel.mesh import AXES, mesh_shape
from trainer_jax.parallel.rules import ShardingRules, path_str


def mesh(**sizes) -> AbstractMesh:
    return AbstractMesh(tuple(sizes.get(a, 1) for a in AXES), AXES)


def _abstract(cfg: Qwen3Config):
    return nnx.eval_shape(lambda: init_model(cfg))


@pytest.mark.parametrize("name", sorted(ALL_CONFIGS))
def test_every_parameter_of_every_tiny_model_has_a_rule(name):
    cfg = Qwen3Config.from_hf_dict({**ALL_CONFIGS[name], "model_type": "qwen3_moe"
                                    if "num_experts" in ALL_CONFIGS[name] else "qwen3"})
    rules = ShardingRules.for_model(cfg)
    state = nnx.state(_abstract(cfg), nnx.Param)
    specs = rules.state_specs(state, mesh(fsdp=2, tensor=2, expert=2), strict=True)
    assert len(jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))) == len(jax.tree.leaves(state))


QWEN3_MOE_30B = Qwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=2,
                            num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                            num_experts_per_tok=8, moe_intermediate_size=768, tie_word_embeddings=False)


def _specs(cfg, m, overrides=None):
    rules = ShardingRules.for_model(cfg, overrides)
    state = nnx.state(_abstract(cfg), nnx.Param)
    flat = jax.tree_util.tree_flatten_with_path(rules.state_specs(state, m, strict=True),
                                                is_leaf=lambda x: isinstance(x, P))[0]
    return {path_str(p): s for p, s in flat}


def test_qwen3_moe_layout_on_fsdp_tensor_expert():
    specs = _specs(QWEN3_MOE_30B, mesh(fsdp=4, expert=8, tensor=2))
    assert specs["embed_tokens/embedding"] == P("tensor", "fsdp")
    assert specs["lm_head/kernel"] == P("fsdp", "tensor")
    assert specs["layers/0/self_attn/q_proj/kernel"] == P("fsdp", "tensor")
    assert specs["layers/0/self_attn/k_proj/kernel"] == P("fsdp", "tensor")  # 4 KV heads / 2
    assert specs["layers/0/self_attn/o_proj/kernel"] == P("tensor", "fsdp")
    assert specs["layers/0/mlp/gate/kernel"] == P("fsdp")
    assert specs["layers/0/mlp/gate_proj"] == P("expert", "fsdp", "tensor")
    assert specs["layers/0/mlp/down_proj"] == P("expert", "tensor", "fsdp")
    assert specs["layers/0/input_layernorm/weight"] == P()


def test_heads_split_only_at_head_boundaries():
    # 4 KV heads of 128 on tensor=8: 512 columns divide by 8, heads do not -> K/V stay whole.
    specs = _specs(QWEN3_MOE_30B, mesh(tensor=8))
    assert specs["layers/0/self_attn/k_proj/kernel"] == P()
    assert specs["layers/0/self_attn/q_proj/kernel"] == P(None, "tensor")


def test_overrides_and_one_use_per_axis():
    # ZeRO-3 over fsdp x expert for dense weights; experts keep the expert axis for themselves.
    specs = _specs(QWEN3_MOE_30B, mesh(fsdp=4, expert=8), {"embed": ["fsdp", "expert"]})
    assert specs["layers/0/self_attn/q_proj/kernel"] == P(("fsdp", "expert"))
    assert specs["layers/0/mlp/gate_proj"] == P("expert", "fsdp")


def test_divisibility_and_batch_axes():
    rules = ShardingRules()
    m = mesh(data=2, fsdp=2, expert=2)
    assert rules.spec(("batch", None), (8, 5), m) == P(("data", "fsdp", "expert"))
    assert rules.spec(("batch", None), (4, 5), m) == P(("data", "fsdp"))  # expert does not fit
    assert rules.spec(("batch",), (3,), m) == P()
    with pytest.raises(ValueError, match="no rule"):
        rules.param_spec("layers/0/mystery/kernel", (4, 4), m)
    assert rules.param_spec("opt_state/0/count", (), m) == P()
    assert rules.param_spec("opt_state/1/mu/layers/0/self_attn/q_proj/kernel", (8, 8), mesh(fsdp=2)) \
        == P("fsdp")


def test_hooks_are_inert_without_a_mesh():
    x = jnp.ones((2, 3))
    assert hooks.active() is None
    assert hooks.constrain(x, ("batch", None)) is x
    assert hooks.override("moe") is None and hooks.override("lse_and_logits_at") is None


@pytest.mark.parametrize("sizes, devices, want", [
    (dict(), 8, dict(data=8, fsdp=1, expert=1, context=1, tensor=1)),
    (dict(fsdp=2, tensor=4), 8, dict(data=1, fsdp=2, expert=1, context=1, tensor=4)),
    (dict(data=2, fsdp=-1, expert=2), 16, dict(data=2, fsdp=4, expert=2, context=1, tensor=1)),
    (dict(data=-1, fsdp=4, dcn_data=2), 16, dict(data=2, fsdp=4, expert=1, context=1, tensor=1)),
])
def test_mesh_shape(sizes, devices, want):
    ici, dcn = mesh_shape(MeshConfig(**sizes), devices)
    assert ici == want
    assert dcn["data"] == sizes.get("dcn_data", 1)


@pytest.mark.parametrize("sizes, devices, match", [
    (dict(fsdp=3), 8, "multiple"), (dict(data=2, fsdp=2), 8, "needs 4 devices"),
    (dict(dcn_data=3), 8, "slices"),
])
def test_mesh_shape_errors(sizes, devices, match):
    with pytest.raises(ValueError, match=match):
        mesh_shape(MeshConfig(**sizes), devices)


@pytest.mark.parametrize("bad, match", [(dict(data=-1, fsdp=-1), "at most one"), (dict(tensor=0), ">= 1"),
                                        (dict(rules={"embed": ["fsdq"]}), "unknown mesh axes")])
def test_mesh_config_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        MeshConfig(**bad)
