"""Acceptance: the vocabulary-parallel lse (and entropy, head logits, gradients) equals unsharded."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer_jax.kernels import linear_logsumexp
from trainer_jax.objective.logits import lse_and_logits_at
from trainer_jax.parallel import ParallelContext, ShardingRules, make_mesh
from trainer_jax.parallel.sharding import put_global
from trainer_jax.parallel.vocab import vocab_parallel_linear_logsumexp, vocab_parallel_lse_and_logits_at

N, D, V = 24, 16, 256


def _problem(seed: int = 0):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.normal(size=(N, D)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(D, V)) * 0.5, jnp.float32)
    ids = jnp.asarray(rng.integers(0, V, (N, 5)), jnp.int32)
    g = jnp.asarray(rng.normal(size=(N,)), jnp.float32)
    return h, w, ids, g


def _context(**axes) -> tuple[ParallelContext, ShardingRules]:
    rules = ShardingRules()
    return ParallelContext(make_mesh(**axes), rules), rules


def _place(ctx, h, w, ids):
    """h / ids split over the batch axes, w over (fsdp, tensor), as in the train step."""
    rules, mesh = ctx.rules, ctx.mesh
    return (put_global(h, rules.sharding(("batch", None), h.shape, mesh)),
            put_global(w, rules.sharding(("embed", "vocab"), w.shape, mesh)),
            put_global(ids, rules.sharding(("batch", None), ids.shape, mesh)))


@pytest.mark.parametrize("axes, impl", [(dict(tensor=8), "xla"), (dict(data=2, tensor=4), "xla"),
                                        (dict(fsdp=2, tensor=4), "xla"), (dict(data=8), "xla"),
                                        (dict(fsdp=2, tensor=4), "reference")])
def test_vocab_parallel_lse_equals_unsharded(axes, impl):
    h, w, _, g = _problem()
    ctx, _ = _context(**axes)
    hs, ws, _ = _place(ctx, h, w, _problem()[2])

    def loss(fn, h, w):
        lse, ent = fn(h, w)
        return jnp.sum(g * lse), (lse, ent)

    opts = {"block_v": 24} if impl == "xla" else {}  # tiles that do not divide a shard's 32 columns
    plain = lambda h, w: linear_logsumexp(h, w, temperature=0.7, impl=impl, **opts)
    split = lambda h, w: vocab_parallel_linear_logsumexp(ctx, h, w, temperature=0.7, impl=impl, **opts)
    (_, (lse, ent)), grads = jax.value_and_grad(lambda *a: loss(plain, *a), (0, 1), has_aux=True)(h, w)
    (_, (lse_p, ent_p)), grads_p = jax.jit(
        jax.value_and_grad(lambda *a: loss(split, *a), (0, 1), has_aux=True))(hs, ws)
    np.testing.assert_allclose(lse_p, lse, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ent_p, ent, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads_p, grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axes", [dict(fsdp=2, tensor=4), dict(data=2, fsdp=2, expert=2)])
def test_lse_and_logits_at_with_head_gather(axes):
    """The objective's entry point: lse, entropy and z at ids, with gradients through all three."""
    h, w, ids, g = _problem(1)
    ctx, _ = _context(**axes)
    hs, ws, ids_s = _place(ctx, h, w, ids)
    gz = jnp.asarray(np.random.default_rng(2).normal(size=ids.shape), jnp.float32)

    def objective(fn, h, w, ids):
        lse, ent, z = fn(h, w, ids, 0.9, "xla", 5)
        return jnp.sum(g * lse) + jnp.sum(gz * z), (lse, ent, z)

    vp = lambda *a: vocab_parallel_lse_and_logits_at(ctx, *a)
    grad = lambda fn: jax.value_and_grad(lambda h, w, i: objective(fn, h, w, i), (0, 1), has_aux=True)
    want = grad(lse_and_logits_at)(h, w, ids)
    got = jax.jit(grad(vp))(hs, ws, ids_s)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_vocab_not_divisible_falls_back_to_the_whole_head():
    h, w, ids, _ = _problem()
    w = w[:, :250]  # 250 columns: the tensor axis (4) does not divide them
    ctx, _ = _context(fsdp=2, tensor=4)
    lse, ent, z = jax.jit(lambda h, w, i: vocab_parallel_lse_and_logits_at(ctx, h, w, i, 1.0, "xla", 8))(
        h, w, ids)
    want = lse_and_logits_at(h, w, ids, 1.0, "xla", 8)
    for a, b in zip((lse, ent, z), want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
