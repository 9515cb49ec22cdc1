"""Ring attention over ``context`` (``parallel/ring.py``) alone: values and gradients equal the
reference attention on the whole row, and the compiled attention moves K/V only by
collective-permutes.

Rows are packed with segments that cross zigzag chunk and device boundaries, start and end at
odd positions, one row a single sequence over the whole row, padding (segment 0) at the end;
chunk lengths 6, 3 and 10 make the kernel's blocks 2, 1 and 10 (the block divides the chunk).
(The all-gather form is checked against the one-device step in ``case_context.py``.)
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer_jax.models.attention import attention
from trainer_jax.parallel import ParallelContext, ShardingRules, make_mesh
from trainer_jax.parallel.sequence import context_attention, zigzag_order

HD = 8
# (mesh, T, query heads, K/V heads)
CASES = {"context4_data2_T48": (dict(context=4, data=2), 48, 4, 2),
         "context8_T48": (dict(context=8, data=1), 48, 4, 4),
         "context2_tensor2_data2_T40": (dict(context=2, tensor=2, data=2), 40, 4, 2)}


def _inputs(t: int, h: int, kh: int, rows: int = 4):
    rng = np.random.default_rng(t + h)
    q = jnp.asarray(rng.normal(size=(rows, t, h, HD)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(rows, t, kh, HD)), jnp.float32) for _ in range(2))
    seg = np.ones((rows, t), np.int32)  # row 0: one sequence over the whole row
    for row in range(1, rows):
        cuts = sorted(rng.choice(np.arange(1, t - 2, 2), 3, replace=False))  # odd starts
        for n, cut in enumerate(cuts):
            seg[row, cut:] = n + 2
        if row % 2:
            seg[row, t - 1 - 2 * row:] = 0  # padding
    cot = jnp.asarray(rng.normal(size=q.shape), jnp.float32) * (jnp.asarray(seg) > 0)[..., None, None]
    return q, k, v, jnp.asarray(seg), cot


@pytest.mark.parametrize("case", list(CASES))
def test_ring_attention_equals_reference(case):
    axes, t, h, kh = CASES[case]
    ctx = ParallelContext(make_mesh(**axes), ShardingRules.for_model(), context_attention="ring")
    q, k, v, seg, cot = _inputs(t, h, kh)
    order = np.asarray(zigzag_order(t, axes["context"]))
    inverse = np.argsort(order)

    def sharded(q, k, v):  # original order in and out; the zigzag layout inside
        lay = lambda x: jnp.take(x, order, axis=1)
        out = context_attention(ctx, lay(q), lay(k), lay(v), lay(seg))
        return jnp.take(out, inverse, axis=1)

    def out_and_grads(f):
        def run(q, k, v):
            out, vjp = jax.vjp(f, q, k, v)
            return out, vjp(cot)
        return run

    step = jax.jit(out_and_grads(sharded))
    out, grads = step(q, k, v)
    want, want_grads = out_and_grads(lambda q, k, v: attention(q, k, v, seg, impl="reference"))(q, k, v)
    real = np.asarray(seg > 0)[..., None, None]  # padding's outputs are unspecified
    np.testing.assert_allclose(np.asarray(out) * real, np.asarray(want) * real, rtol=1e-5, atol=1e-5)
    for name, g, w in zip("qkv", grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=f"d{name}")
    if case == "context4_data2_T48":
        _check_ring_collectives(step.lower(q, k, v).compile().as_text())


def _check_ring_collectives(hlo: str) -> None:
    """K/V (``[.., K, .., hd]`` with T or T/C positions) travel by collective-permutes only; the
    one all-gather over context is the row's segment ids ``[rows, T]`` (int32, skip bounds)."""
    gathers = re.findall(r"= (\w+)\[([\d,]*)\][^ ]* all-gather(?:-start)?\(", hlo)
    assert all(dtype == "s32" and len(dims.split(",")) == 2 for dtype, dims in gathers), gathers
    permutes = re.findall(r"= \(?(\w+)\[([\d,]*)\][^ ]* collective-permute(?:-start)?\(", hlo)
    kv_permutes = [d for _, d in permutes if d.endswith(f",{HD}") and len(d.split(",")) == 4]
    # K and V hop in the forward's and the backward's ring loops, dK and dV in the backward's
    # loop and once after it (the last hop home)
    assert len(kv_permutes) >= 2 + 2 + 2 + 2, permutes
