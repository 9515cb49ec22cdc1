"""The sharded embedding lookup: values and table gradient equal the unsharded ones, and the
backward moves the cotangent rows with an all-to-all instead of gathering every row everywhere."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer_jax.parallel import ParallelContext, ShardingRules, make_mesh
from trainer_jax.parallel.embed import embed_lookup
from trainer_jax.parallel.sharding import put_global

B, T, V, D = 8, 16, 64, 32


@pytest.mark.parametrize("axes, embed", [(dict(data=2, fsdp=2, expert=2), None),
                                         (dict(data=2, fsdp=2, expert=2), ("fsdp", "expert")),
                                         (dict(fsdp=2, tensor=4), None), (dict(data=8), None)])
def test_embed_lookup_equals_unsharded_and_reshards_with_all_to_all(axes, embed):
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.normal(size=(V, D)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    cot = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    rules = ShardingRules.for_model(overrides={"embed": embed} if embed else None)
    ctx = ParallelContext(make_mesh(**axes), rules)
    mesh = ctx.mesh
    table_s = put_global(table, rules.sharding(("vocab", "embed"), table.shape, mesh))
    ids_s = put_global(ids, rules.sharding(("batch", "seq"), ids.shape, mesh))
    cot_s = put_global(cot, rules.sharding(("batch", "seq", None), cot.shape, mesh))

    def loss(lookup, table, ids, cot):
        return jnp.sum(lookup(table, ids) * cot)

    plain = jax.value_and_grad(lambda t: loss(lambda t, i: t[i], t, ids, cot))(table)
    step = jax.jit(jax.value_and_grad(lambda t, i, c: loss(lambda t, i: embed_lookup(ctx, t, i), t, i, c)))
    sharded = step(table_s, ids_s, cot_s)
    np.testing.assert_allclose(sharded[0], plain[0], rtol=1e-5)
    np.testing.assert_allclose(sharded[1], plain[1], rtol=1e-6, atol=1e-6)

    hlo = step.lower(table_s, ids_s, cot_s).compile().as_text()
    # No collective may produce the whole step's rows [B, T, D] on a device.
    whole = re.compile(rf"f32\[{B},{T},{D}\][^=]*= [^ ]* ?(all-gather|all-reduce)|"
                       rf"= f32\[{B},{T},{D}\]\S* (all-gather|all-reduce)")
    assert not whole.search(hlo)
    if axes.get("fsdp", 1) > 1:  # rows split over fsdp by batch go to the fsdp split of D
        assert "all-to-all" in hlo
