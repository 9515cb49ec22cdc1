"""Acceptance: a checkpoint written on one mesh restores onto another (and to / from one device).

``trainer_jax.checkpoint.Checkpointer`` saves the global arrays of a ``Learner`` shard by
shard; restoring into a learner on another mesh reads each array with the *target's* sharding.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from mesh_common import MESHES, MOE, host

from trainer_jax.checkpoint import Checkpointer
from trainer_jax.learner import Learner, OptimizerConfig
from trainer_jax.models import init_model
from trainer_jax.objective import ObjectiveConfig
from trainer_jax.parallel import make_mesh
from trainer_jax.parallel.sharding import put_global

OPT, OBJ = OptimizerConfig(), ObjectiveConfig()


def _scramble(learner, seed: int) -> None:
    """Give every optimizer slot and the step counter distinct values (no train step needed)."""
    rng = np.random.default_rng(seed)
    state = nnx.state(learner.optimizer)

    def one(x):
        value = rng.integers(1, 1000, x.shape) if x.dtype.kind in "iu" else rng.normal(size=x.shape)
        return put_global(np.asarray(value, x.dtype), x.sharding)

    nnx.update(learner.optimizer, jax.tree.map(one, state))


def _learner(where: str, seed: int):
    if where == "single":
        return Learner(init_model(MOE, seed=seed), OPT, OBJ)
    return Learner(init_model(MOE, seed=seed), OPT, OBJ, make_mesh(**MESHES[where]))


def _state(learner):
    return nnx.state((learner.model, learner.optimizer))


@pytest.mark.parametrize("source, target", [("2fsdp_4tensor", "2data_2fsdp_2expert"),
                                            ("2data_2fsdp_2expert", "8data"),
                                            ("8data", "single"), ("single", "2fsdp_4tensor")])
def test_restore_onto_another_mesh(tmp_path, source, target):
    saved = _learner(source, seed=0)
    _scramble(saved, seed=1)
    expected = host(_state(saved))
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(5, saved.model, saved.optimizer, {"step": 5, "mesh": source})
    ckpt.close()

    restored = _learner(target, seed=3)
    shardings_before = [x.sharding for x in jax.tree.leaves(_state(restored))]
    meta = Checkpointer(tmp_path / "ckpt").restore(restored.model, restored.optimizer)
    assert meta == {"step": 5, "mesh": source}
    got = _state(restored)
    for a, b in zip(jax.tree.leaves(host(got)), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)
    # Every array now lives on the target's devices with the target's layout.
    for leaf, sharding in zip(jax.tree.leaves(got), shardings_before, strict=True):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (leaf.sharding, sharding)
