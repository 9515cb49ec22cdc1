import jax
import numpy as np
import pytest

from convert.qwen3_config import Qwen3Config
from trainer_jax.checkpoint import Checkpointer
from trainer_jax.learner import Learner, OptimizerConfig
from trainer_jax.models import init_model
from trainer_jax.objective import ObjectiveConfig

CFG = Qwen3Config(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=8)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_save_restore_params_optimizer_and_meta(tmp_path):
    from flax import nnx

    learner = Learner(init_model(CFG, seed=0), OptimizerConfig(), ObjectiveConfig())
    # Make the optimizer state non-trivial without a full training step.
    learner.optimizer.step.set_value(learner.optimizer.step.get_value() + 7)
    ckpt = Checkpointer(tmp_path / "ckpt", keep_last=2)
    meta = {"step": 7, "cursor": 123, "done_tasks": [1, 2, 3], "rng": [1, 2]}
    ckpt.save(7, learner.model, learner.optimizer, meta)

    fresh = Learner(init_model(CFG, seed=1), OptimizerConfig(), ObjectiveConfig())
    params = lambda learner: _leaves(nnx.state(learner.model, nnx.Param))
    assert not all(np.array_equal(a, b) for a, b in zip(params(fresh), params(learner), strict=True))
    got = Checkpointer(tmp_path / "ckpt").restore(fresh.model, fresh.optimizer)
    assert got == meta and fresh.step_count == 7
    for a, b in zip(params(fresh), params(learner), strict=True):
        np.testing.assert_array_equal(a, b)


def test_keeps_last_k_and_reports_missing(tmp_path):
    learner = Learner(init_model(CFG), OptimizerConfig(), ObjectiveConfig())
    ckpt = Checkpointer(tmp_path / "c", keep_last=2)
    for step in (1, 2, 3):
        ckpt.save(step, learner.model, learner.optimizer, {"step": step})
    assert ckpt.manager.all_steps() == [2, 3] and ckpt.latest_step() == 3
    with pytest.raises(FileNotFoundError):
        Checkpointer(tmp_path / "empty").restore(learner.model, learner.optimizer)
