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
    # The blocked form multiplies at most (M + E * (block - 1)) / block blocks, since each group
    # wastes fewer than a block; a dense lowering would run E * M rows.
    x, w = jnp.ones((256, 8)), jnp.ones((16, 8, 4))
    gs = jnp.full((16,), 16, jnp.int32)
    jaxpr = jax.make_jaxpr(lambda x, w: grouped_matmul(x, w, gs, impl="blocked", block=32))(x, w)
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 1 and dots[0].outvars[0].aval.shape == ((256 + 16 * 31) // 32, 32, 4)


def _per_row_ffn(tokens, group_of_row, copies, wg, wu, wd):
    """The expert SwiGLU row by row: row i is token i // copies through its group's weights."""
    x = tokens[jnp.arange(group_of_row.shape[0]) // copies]
    g = jnp.clip(group_of_row, 0, wg.shape[0] - 1)
    hidden = jax.nn.silu(jnp.einsum("md,mdf->mf", x, wg[g])) * jnp.einsum("md,mdf->mf", x, wu[g])
    out = jnp.einsum("mf,mfd->md", hidden, wd[g])
    valid = (group_of_row >= 0) & (group_of_row < wg.shape[0])
    return jnp.where(valid[:, None], out, 0), hidden


@pytest.mark.parametrize("impl", ["ragged_dot", "blocked"])
@pytest.mark.parametrize("copies", [1, 2])
def test_one_grouping_serves_an_expert_ffn(impl, copies):
    # Rows in any group order (a MoE's top-k copies), some in no group (another device's experts):
    # pack once, gate and up as one pair, down, unpack once gives the per-row SwiGLU, values and
    # gradients (pack and unpack have gather-only backwards of their own), with zeros for rows of
    # no group; the packed rows' per-group maxima (what calibration records) equal the per-row ones.
    num_tokens, e = 29, 4
    group_of_row = jax.random.randint(jax.random.key(9), (num_tokens * copies,), -1, e + 1)
    group_of_row = group_of_row.at[:3].set(2)  # group 1 may be empty; group 2 is not
    tokens = jax.random.normal(jax.random.key(0), (num_tokens, 16))
    wg, wu = (jax.random.normal(jax.random.key(i), (e, 16, 8)) for i in (1, 2))
    wd = jax.random.normal(jax.random.key(3), (e, 8, 16))
    rows = group_rows(group_of_row, e, impl=impl, block=8)

    def ffn(tokens, wg, wu, wd):
        packed = rows.pack(tokens, copies=copies)
        gate, up = rows.matmul_pair(packed, wg, wu)
        hidden = jax.nn.silu(gate) * up
        return rows.unpack(rows.matmul(hidden, wd)), hidden

    got, hidden = ffn(tokens, wg, wu, wd)
    packed = rows.pack(tokens, copies=copies)
    np.testing.assert_allclose(rows.matmul_pair(packed, wg, wu)[0], rows.matmul(packed, wg),
                               rtol=1e-5, atol=1e-5)
    ref, ref_hidden = _per_row_ffn(tokens, group_of_row, copies, wg, wu, wd)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    assert not np.any(np.asarray(got)[np.asarray((group_of_row < 0) | (group_of_row >= e))])

    cot = jax.random.normal(jax.random.key(5), ref.shape)
    loss = lambda fn: lambda *a: jnp.sum(fn(*a)[0] * cot)
    g_got = jax.grad(loss(ffn), (0, 1, 2, 3))(tokens, wg, wu, wd)
    g_ref = jax.grad(loss(lambda *a: _per_row_ffn(a[0], group_of_row, copies, *a[1:])),
                     (0, 1, 2, 3))(tokens, wg, wu, wd)
    for a, b in zip(g_got, g_ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)

    valid = (group_of_row >= 0) & (group_of_row < e)
    with capture.recording() as got_max:
        capture.grouped_amax("h", rows.rows(hidden), rows.packed_sizes)
    order = jnp.argsort(jnp.where(valid, group_of_row, e), stable=True)
    with capture.recording() as ref_max:
        capture.grouped_amax("h", ref_hidden[order], rows.group_sizes)
    np.testing.assert_allclose(got_max[0][1], ref_max[0][1], rtol=1e-5)
    np.testing.assert_array_equal(rows.group_sizes, np.bincount(group_of_row[valid], minlength=e))


@pytest.mark.parametrize("impl", ["ragged_dot", "blocked"])
def test_unpack_combine_is_the_weighted_sum_of_each_tokens_copies(impl):
    # A MoE's combine: token n's output is sum_j weights[n, j] * (its copy j's row); copies of no
    # group (another device's experts) add nothing. Values and both gradients.
    num_tokens, k, e = 23, 3, 4
    group_of_row = jax.random.randint(jax.random.key(1), (num_tokens * k,), -1, e + 1)
    rows = group_rows(group_of_row, e, impl=impl, block=4)
    y = jax.random.normal(jax.random.key(2), rows.pack(jnp.ones((num_tokens, 5)), copies=k).shape)
    weights = jax.random.uniform(jax.random.key(3), (num_tokens, k))
    cot = jax.random.normal(jax.random.key(4), (num_tokens, 5))

    def ref(y, weights):  # plain indexing, autodiff's own scatter-add backward
        copies = jnp.where(rows.row_valid[:, None], rows.rows(y)[rows.slot_of_row], 0)
        return jnp.sum(copies.reshape(num_tokens, k, -1) * weights[..., None], axis=1)

    np.testing.assert_allclose(rows.unpack_combine(y, weights), ref(y, weights), rtol=1e-5,
                               atol=1e-6)
    grads = [jax.grad(lambda y, w, fn=fn: jnp.sum(fn(y, w) * cot), (0, 1))(y, weights)
             for fn in (rows.unpack_combine, ref)]
    for got, want in zip(*grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["ragged_dot", "blocked"])
def test_rows_past_the_groups_come_out_zero(impl):
    sizes = [5, 9]
    x = jax.random.normal(jax.random.key(0), (sum(sizes) + 11, 4))
    w = jax.random.normal(jax.random.key(1), (2, 4, 3))
    got = grouped_matmul(x, w, jnp.asarray(sizes, jnp.int32), impl=impl, block=4)
    np.testing.assert_allclose(got[:sum(sizes)], _naive(x, w, sizes), rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(got[sum(sizes):]))


def test_unknown_impl():
    with pytest.raises(ValueError, match="impl"):
        grouped_matmul(jnp.ones((2, 2)), jnp.ones((1, 2, 2)), jnp.asarray([2]), impl="dense")
