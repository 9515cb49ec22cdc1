import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer_jax.models.grouped_matmul import grouped_matmul


def _naive(x, w, sizes):
    out, start = [], 0
    for e, n in enumerate(sizes):
        out.append(x[start:start + n] @ w[e])
        start += n
    return jnp.concatenate(out)


@pytest.mark.parametrize("impl", ["ragged_dot", "blocked"])
@pytest.mark.parametrize("sizes", [[50, 0, 3, 120, 27], [0, 0, 9], [64, 64]])
def test_matches_per_group_matmul_values_and_grads(impl, sizes):
    x = jax.random.normal(jax.random.key(0), (sum(sizes), 16))
    w = jax.random.normal(jax.random.key(1), (len(sizes), 16, 7))
    gs = jnp.asarray(sizes, jnp.int32)
    got = grouped_matmul(x, w, gs, impl=impl, block=8)
    np.testing.assert_allclose(got, _naive(x, w, sizes), rtol=1e-5, atol=1e-5)

    def loss(fn):
        return lambda x, w: jnp.sum(jnp.sin(fn(x, w)))

    g_got = jax.grad(loss(lambda x, w: grouped_matmul(x, w, gs, impl=impl, block=8)), (0, 1))(x, w)
    g_ref = jax.grad(loss(lambda x, w: _naive(x, w, sizes)), (0, 1))(x, w)
    for a, b in zip(g_got, g_ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_blocked_work_is_bounded_not_dense():
    # The blocked scan runs ceil(M/block) + E block matmuls; a dense lowering would run E * M rows.
    x, w = jnp.ones((256, 8)), jnp.ones((16, 8, 4))
    gs = jnp.full((16,), 16, jnp.int32)
    jaxpr = jax.make_jaxpr(lambda x, w: grouped_matmul(x, w, gs, impl="blocked", block=32))(x, w)
    scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert len(scans) == 1 and scans[0].params["length"] == 256 // 32 + 16


def test_unknown_impl():
    with pytest.raises(ValueError, match="impl"):
        grouped_matmul(jnp.ones((2, 2)), jnp.ones((1, 2, 2)), jnp.asarray([2]), impl="dense")
