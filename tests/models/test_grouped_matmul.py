import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer_jax.models import capture
from trainer_jax.models.grouped_matmul import group_rows, grouped_matmul


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
    # The blocked form multiplies ceil(M/block) + E blocks; a dense lowering would run E * M rows.
    x, w = jnp.ones((256, 8)), jnp.ones((16, 8, 4))
    gs = jnp.full((16,), 16, jnp.int32)
    jaxpr = jax.make_jaxpr(lambda x, w: grouped_matmul(x, w, gs, impl="blocked", block=32))(x, w)
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 1 and dots[0].outvars[0].aval.shape == (256 // 32 + 16, 32, 4)


@pytest.mark.parametrize("impl", ["ragged_dot", "blocked"])
def test_one_grouping_serves_an_expert_ffn(impl):
    # pack once, gate and up as one pair, down, unpack once: the same SwiGLU as per-group
    # matmuls, and the packed rows' per-group maxima (what calibration records) equal the
    # unpacked ones.
    sizes = [13, 0, 40, 7]
    x = jax.random.normal(jax.random.key(0), (sum(sizes), 16))
    wg, wu = (jax.random.normal(jax.random.key(i), (4, 16, 8)) for i in (1, 2))
    wd = jax.random.normal(jax.random.key(3), (4, 8, 16))
    gs = jnp.asarray(sizes, jnp.int32)
    rows = group_rows(gs, x.shape[0], impl=impl, block=8)
    packed = rows.pack(x)
    gate, up = rows.matmul_pair(packed, wg, wu)
    np.testing.assert_allclose(gate, rows.matmul(packed, wg), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(up, rows.matmul(packed, wu), rtol=1e-5, atol=1e-5)
    hidden = jax.nn.silu(gate) * up
    got = rows.unpack(rows.matmul(hidden, wd))
    ref_hidden = jax.nn.silu(_naive(x, wg, sizes)) * _naive(x, wu, sizes)
    np.testing.assert_allclose(got, _naive(ref_hidden, wd, sizes), rtol=1e-4, atol=1e-4)
    with capture.recording() as got_max:
        capture.grouped_amax("h", rows.rows(hidden), rows.packed_sizes)
    with capture.recording() as ref_max:
        capture.grouped_amax("h", ref_hidden, gs)
    np.testing.assert_allclose(got_max[0][1], ref_max[0][1], rtol=1e-5)


def test_rows_past_the_groups_leave_the_groups_alone():
    # The expert-parallel dispatch passes copies for other devices' experts as trailing rows.
    sizes = [5, 9]
    x = jax.random.normal(jax.random.key(0), (sum(sizes) + 11, 4))
    w = jax.random.normal(jax.random.key(1), (2, 4, 3))
    got = grouped_matmul(x, w, jnp.asarray(sizes, jnp.int32), impl="blocked", block=4)
    np.testing.assert_allclose(got[:sum(sizes)], _naive(x, w, sizes), rtol=1e-5, atol=1e-5)


def test_unknown_impl():
    with pytest.raises(ValueError, match="impl"):
        grouped_matmul(jnp.ones((2, 2)), jnp.ones((1, 2, 2)), jnp.asarray([2]), impl="dense")
