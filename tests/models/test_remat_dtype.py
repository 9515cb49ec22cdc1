"""Per-layer rematerialisation changes no gradient; bf16 compute keeps fp32 parameters and state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from convert.qwen3_config import Qwen3Config
from tests.tiny_models import DENSE_CONFIGS, MOE_CONFIGS
from trainer_jax.models import init_model
from trainer_jax.models.remat import _runs, remat_options


def _grads(cfg: Qwen3Config, remat: str, **kw):
    model = init_model(cfg, seed=1, remat=remat, **kw)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 24)), jnp.int32)
    seg = jnp.asarray(np.repeat([[1] * 10 + [2] * 11 + [0] * 3], 2, axis=0), jnp.int32)

    graphdef, params = nnx.split(model)

    def loss(p):
        logits = nnx.merge(graphdef, p)(ids, segment_ids=seg)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()

    # jitted: op by op, the scanned remat stack took minutes on two cores
    return jax.jit(jax.grad(loss))(params)


@pytest.mark.parametrize("config", ["dense_untied_gqa4", "moe_norm_topk"])
# nothing_saveable keeps what "full" keeps (the layer inputs): slow-marked, for the suite's time.
@pytest.mark.parametrize("remat", ["full", "dots_with_no_batch_dims_saveable",
                                   pytest.param("nothing_saveable", marks=pytest.mark.slow)])
def test_remat_changes_no_gradient(config, remat):
    cfg = Qwen3Config(**{**DENSE_CONFIGS, **MOE_CONFIGS}[config])
    plain = jax.tree.leaves(_grads(cfg, "none"))
    with_remat = jax.tree.leaves(_grads(cfg, remat))
    assert len(plain) == len(with_remat) > 0
    for a, b in zip(plain, with_remat, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.max(np.abs(a - b)) <= 1e-6 * max(np.max(np.abs(a)), 1e-30)


def test_remat_scans_runs_of_same_structure_layers():
    """With remat on, each run of same-structure layers is one scan of a checkpointed body."""
    ids = jnp.zeros((1, 8), jnp.int32)

    def jaxpr(cfg, remat):  # dense attention: the blocked form's own loops would be scans too
        graphdef, params = nnx.split(init_model(cfg, remat=remat, attention_impl="reference"))
        return str(jax.make_jaxpr(lambda p: nnx.merge(graphdef, p)(ids).sum())(params))

    dense = Qwen3Config(**DENSE_CONFIGS["dense_untied_gqa4"])  # 3 dense layers: one scan
    plain = jaxpr(dense, "none")
    assert "scan[" not in plain and "remat" not in plain
    text = jaxpr(dense, "full")
    assert text.count("scan[") == 1 and f"length={dense.num_hidden_layers}" in text
    assert "remat" in text  # jax.checkpoint's primitive (remat2)
    mixed = init_model(Qwen3Config(**MOE_CONFIGS["moe_mlp_only_layers"]))  # dense, MoE, dense
    assert [len(states) for _, states in _runs(list(mixed.layers))] == [1, 1, 1]
    assert [len(states) for _, states in _runs(list(init_model(dense).layers))] == [3]


def test_full_remat_bounds_activation_memory():
    """XLA's temporary memory for a gradient over 8 layers: full remat well under none.

    Per-layer ``jax.checkpoint`` on unrolled layers left it unchanged on XLA:CPU (the scheduler
    ran every recomputation early); the scanned stack recomputes one layer at a time.
    """
    cfg = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    ids = jnp.zeros((2, 512), jnp.int32)

    def temp_bytes(remat):
        # Dense attention, so each layer keeps its [T, T] scores for remat to drop. With the
        # blocked form (CPU's auto) a layer keeps less and the ratio at this toy size is 3.99;
        # bench_train_memory.py measures the auto path at the Qwen3-0.6B shape.
        model = init_model(cfg, remat=remat, attention_impl="reference")
        graphdef, params = nnx.split(model)
        grad = jax.grad(lambda p: nnx.merge(graphdef, p).hidden_states(ids).astype(jnp.float32).sum())
        return jax.jit(grad).lower(params).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes("full") * 4 <= temp_bytes("none")


def test_unknown_remat_is_rejected():
    cfg = Qwen3Config(**DENSE_CONFIGS["dense_tied_gqa2"])
    with pytest.raises(ValueError, match="remat"):
        init_model(cfg, remat="save_only_these_names")
    assert "full" in remat_options() and "dots_with_no_batch_dims_saveable" in remat_options()


def test_bf16_compute_over_fp32_parameters_and_optimizer_state():
    cfg = Qwen3Config(**DENSE_CONFIGS["dense_untied_gqa4"])
    model = init_model(cfg, dtype=jnp.bfloat16, param_dtype=jnp.float32, seed=3)
    ref = init_model(cfg, dtype=jnp.float32, seed=3)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16)), jnp.int32)

    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert params and all(p.dtype == jnp.float32 for p in params)
    hidden = model.hidden_states(ids)
    assert hidden.dtype == jnp.bfloat16  # activations are bf16
    # The layer matmuls run in bf16: the jaxpr's dot_generals take bf16 operands.
    jaxpr = str(jax.make_jaxpr(lambda: model.hidden_states(ids))())
    assert "dot_general" in jaxpr and "bf16[2,16,48]" in jaxpr
    np.testing.assert_allclose(np.asarray(model(ids)), np.asarray(ref(ids)), atol=5e-2)

    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    grads = nnx.grad(lambda m: m(ids).astype(jnp.float32).mean())(model)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    opt.update(model, grads)
    state = [x for x in jax.tree.leaves(nnx.state(opt)) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert state and all(x.dtype == jnp.float32 for x in state)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
