"""Attention on a mesh: each device runs the kernel on its own rows and heads (``shard_map``).

Values and gradients equal the unsharded ones; the forward has no collective at all; the fused
kernel (Pallas in interpret mode here) sees the per-device shapes, not the global ones; and the
model's decoder layers reach the sharded form.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from convert.qwen3_config import Qwen3Config
from trainer_jax.models import Qwen3
from trainer_jax.models.attention import attention
from trainer_jax.parallel import ParallelContext, ShardingRules, dispatch, make_mesh
from trainer_jax.parallel.attention import attention_forward, head_layout
from trainer_jax.parallel.sharding import put_global

B, T, HD = 8, 32, 16
COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)"
                        r"(-start)?\(")
# (mesh, query heads, K/V heads): K/V split with the queries; K/V whole with one K/V head picked
# per device (8 and 4 tensor shards, groups of 2 and 4); batch only.
CASES = [(dict(data=8), 8, 4), (dict(fsdp=2, tensor=4), 8, 4), (dict(data=2, fsdp=2, tensor=2), 8, 4),
         (dict(tensor=8), 8, 4), (dict(data=2, tensor=4), 8, 2)]


def _inputs(h: int, k: int):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(B, T, h, HD)), jnp.float32)
    kv = [jnp.asarray(rng.normal(size=(B, T, k, HD)), jnp.float32) for _ in range(2)]
    seg = np.ones((B, T), np.int32)
    for row in range(B):  # two or three sequences, then padding
        cuts = sorted(rng.choice(np.arange(3, T - 4), 2, replace=False))
        seg[row, cuts[0]:] = 2
        seg[row, cuts[1]:] = 3 if row % 2 else 0
    cot = jnp.asarray(rng.normal(size=(B, T, h, HD)), jnp.float32) * (jnp.asarray(seg) > 0)[..., None, None]
    return q, kv[0], kv[1], jnp.asarray(seg), cot


def _loss(attend, q, k, v, seg, cot):
    return jnp.sum(attend(q, k, v, seg) * cot)


# The blocked form on every layout; the fused kernel (Pallas, interpret mode: ~20 s of compile a
# layout) on the layout that picks one K/V head per device. Its other four layouts are `slow`
# (make test-slow): the map around the kernel is the blocked form's, the kernel equals the
# reference on one device (tests/models/test_attention.py), and
# test_the_kernel_sees_per_device_shapes checks its shapes on all five.
_PALLAS = ("pallas_gpu", {"interpret": True, "block": 16})
FORMS = [pytest.param(*case, "blocked", {"block": 16}, id=f"case{i}-blocked") for i, case in enumerate(CASES)]
FORMS += [pytest.param(*case, *_PALLAS, id=f"case{i}-pallas_gpu",
                       marks=[] if case == CASES[-1] else [pytest.mark.slow]) for i, case in enumerate(CASES)]


@pytest.mark.parametrize("axes, h, k, impl, options", FORMS)
def test_sharded_attention_equals_unsharded_without_collectives(axes, h, k, impl, options):
    q, kk, v, seg, cot = _inputs(h, k)
    ctx = ParallelContext(make_mesh(**axes), ShardingRules.for_model())
    mesh, rules = ctx.mesh, ctx.rules
    q_s = put_global(q, rules.sharding(("batch", "seq", "heads", None), q.shape, mesh))
    kv_sharding = rules.sharding(("batch", "seq", "kv_heads", None), kk.shape, mesh)
    k_s, v_s = put_global(kk, kv_sharding), put_global(v, kv_sharding)
    seg_s = put_global(seg, rules.sharding(("batch", "seq"), seg.shape, mesh))
    cot_s = put_global(cot, q_s.sharding)

    def plain(q, k, v, s):
        return attention(q, k, v, s, impl="reference")

    def sharded(q, k, v, s):
        return attention_forward(ctx, q, k, v, s, impl=impl, **options)

    want = jax.value_and_grad(lambda *a: _loss(plain, *a, seg, cot), argnums=(0, 1, 2))(q, kk, v)
    step = jax.jit(jax.value_and_grad(lambda q, k, v, s, c: _loss(sharded, q, k, v, s, c),
                                      argnums=(0, 1, 2)))
    got = step(q_s, k_s, v_s, seg_s, cot_s)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)

    # Forward: no communication (the blocked form's block bounds, a min over the rows, would
    # all-reduce across the batch shards if the partitioner split it).
    forward = jax.jit(sharded).lower(q_s, k_s, v_s, seg_s).compile().as_text()
    assert not COLLECTIVE.search(forward), COLLECTIVE.search(forward).group(0)


@pytest.mark.parametrize("axes, h, k", CASES)
def test_the_kernel_sees_per_device_shapes(axes, h, k):
    q, kk, v, seg, _ = _inputs(h, k)
    ctx = ParallelContext(make_mesh(**axes), ShardingRules.for_model())
    q_spec, kv_spec, pick = head_layout(ctx, q.shape, kk.shape)
    shards = {name: size for name, size in ctx.mesh.shape.items()}

    def split(dim, entry):
        axes_ = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        return dim // int(np.prod([shards[a] for a in axes_]))

    local_q = (split(B, q_spec[0]), T, split(h, q_spec[2]), HD)
    assert local_q[0] < B or local_q[2] < h  # every case splits something
    jaxpr = str(jax.make_jaxpr(lambda *a: attention_forward(
        ctx, *a, impl="pallas_gpu", interpret=True, block=16))(q, kk, v, seg))
    # The kernel's output (its inputs' shape: K/V are repeated to the query heads) is per device.
    kernels = re.findall(r":f32\[(\d+),(\d+),(\d+),(\d+)\] = pallas_call", jaxpr)
    assert kernels and {tuple(map(int, s)) for s in kernels} == {local_q}, (kernels, local_q)
    # K/V whole in the map, one head taken per device, exactly where the K/V heads cannot split.
    assert bool(pick) == (k % shards["tensor"] != 0)


def test_the_model_reaches_sharded_attention():
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    ids = jnp.ones((8, 16), jnp.int32)
    seg = jnp.ones((8, 16), jnp.int32)
    ctx = ParallelContext(make_mesh(data=4, tensor=2), ShardingRules.for_model(cfg))
    graphdef, state = nnx.split(model)

    def forward(state, ids, seg):
        with dispatch.use(ctx):
            return nnx.merge(graphdef, state).hidden_states(ids, segment_ids=seg)

    def plain(state, ids, seg):
        return nnx.merge(graphdef, state).hidden_states(ids, segment_ids=seg)

    jaxpr = str(jax.make_jaxpr(forward)(state, ids, seg))
    # One map per decoder layer, each over per-device [2 rows, 16, 2 heads, 8] queries.
    assert jaxpr.count("shard_map") >= cfg.num_hidden_layers
    assert "f32[2,16,2,8]" in jaxpr
    assert "shard_map" not in str(jax.make_jaxpr(plain)(state, ids, seg))  # no context: unsharded
    # Jitted: run eagerly, the reference compiled each of its ops alone (~60 s of the file).
    want = jax.jit(plain)(state, ids, seg)
    np.testing.assert_allclose(jax.jit(forward)(state, ids, seg), want, rtol=1e-5, atol=1e-5)


def test_splash_under_the_map():
    """TPU splash attention (interpret mode; its blocks are at least 128) on 2 data x 4 tensor."""
    q, kk, v, seg, _ = _inputs(8, 4)
    ctx = ParallelContext(make_mesh(data=2, tensor=4), ShardingRules.for_model())
    out = jax.jit(lambda *a: attention_forward(ctx, *a, impl="splash", interpret=True))(q, kk, v, seg)
    want = attention(q, kk, v, seg, impl="reference")
    real = np.asarray(seg) > 0  # padding's outputs are unspecified
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(want)[real], rtol=1e-5, atol=1e-5)
