import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from convert.qwen3_config import Qwen3Config
from trainer_jax.batching import Sample, pack
from trainer_jax.learner import Learner, OptimizerConfig, loss_and_metrics, policy_hidden
from trainer_jax.models import init_model
from trainer_jax.objective import ObjectiveConfig, reduce_metrics

CFG = Qwen3Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)


def _sample(rng, length, policy, version=0, logprob=-3.9):
    ids = rng.integers(0, CFG.vocab_size, length).astype(np.int32)
    mask = np.zeros(length, np.int32)
    mask[length - policy:] = 1
    return Sample(token_ids=ids, loss_mask=mask, logprobs=np.full(policy, logprob, np.float32),
                  head_ids=np.tile(np.arange(4, dtype=np.int32), (policy, 1)),
                  head_logprobs=np.full((policy, 4), logprob, np.float32),
                  support_indptr=np.zeros(policy + 1, np.int32), support_ids=np.zeros(0, np.int32),
                  support_logprobs=np.zeros(0, np.float32), versions=np.full(policy, version, np.int32))


def _pack(samples, **kw):
    args = dict(rows=2, row_len=32, max_tokens=32, head_k=4, support_k=4, temperature=1.0, trainer_version=0)
    args.update(kw)
    return pack(samples, np.linspace(-1, 1, len(samples)), **args)


def test_packed_hidden_states_equal_unpacked_forward():
    rng = np.random.default_rng(0)
    model = init_model(CFG, seed=1)
    samples = [_sample(rng, 10, 4), _sample(rng, 12, 6), _sample(rng, 7, 3), _sample(rng, 20, 10)]
    inputs, batch, taken = _pack(samples)
    assert taken == [0, 1, 2, 3]
    assert np.asarray(inputs.segment_ids).max() == 3  # three sequences share the first row
    packed = np.asarray(policy_hidden(model, inputs))
    n = 0
    for s in samples:
        hidden = np.asarray(model.hidden_states(jnp.asarray(s.token_ids[None])))[0]
        cols = np.nonzero(s.loss_mask)[0] - 1
        np.testing.assert_allclose(packed[n:n + len(cols)], hidden[cols], atol=1e-5)
        assert np.array_equal(np.asarray(batch.token_ids[n:n + len(cols)]), s.token_ids[cols + 1])
        n += len(cols)
    assert float(batch.loss_mask.sum()) == n and float(batch.loss_mask[n:].sum()) == 0


def test_overflow_is_left_for_later_and_staleness_masks():
    rng = np.random.default_rng(1)
    samples = [_sample(rng, 30, 10), _sample(rng, 30, 10), _sample(rng, 30, 10, version=0)]
    _, _, taken = _pack(samples)
    assert taken == [0, 1]  # two rows of 32 hold two 30-token sequences
    _, batch, taken = _pack(samples[:1], trainer_version=5, max_staleness=2)
    assert taken == [0] and float(batch.loss_mask.sum()) == 0
    with pytest.raises(ValueError, match="row_len"):
        _pack([_sample(rng, 40, 5)])


def test_sample_validation():
    rng = np.random.default_rng(2)
    s = _sample(rng, 8, 3)
    with pytest.raises(ValueError, match="logprobs"):
        Sample(**{**s.__dict__, "logprobs": np.zeros(2, np.float32)})
    mask = s.loss_mask.copy()
    mask[0] = 1
    with pytest.raises(ValueError, match="first token"):
        Sample(**{**s.__dict__, "loss_mask": mask})


def test_steps_descend_on_a_fixed_batch_and_report_metrics():
    rng = np.random.default_rng(3)
    model = init_model(CFG, seed=2)
    inputs, batch, _ = _pack([_sample(rng, 12, 6) for _ in range(4)])
    learner = Learner(model, OptimizerConfig(learning_rate=3e-3), ObjectiveConfig(is_mode="none",
                                                                                 score_centering=False))
    losses = [learner.step(inputs, batch).loss for _ in range(5)]
    assert losses[-1] < losses[0] and learner.step_count == 5
    before = jax.tree.map(np.asarray, learner.model.embed_tokens.embedding.get_value())
    result = learner.step(inputs, batch)
    assert np.isfinite(result.grad_norm) and result.grad_norm > 0
    assert not np.array_equal(before, np.asarray(learner.model.embed_tokens.embedding.get_value()))
    metrics = reduce_metrics(result.metrics)
    assert float(metrics["tokens"]) == 24 and 0 <= float(metrics["out_of_range"]) <= 1


MOE = Qwen3Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=16)


@pytest.mark.parametrize("cfg", [CFG, MOE], ids=["dense", "moe"])
def test_micro_batching_changes_no_gradient(cfg):
    """Rows through the model two (or one) at a time, each micro-batch rematerialised, give the
    one-shot loss and gradient within 1e-6 relative; the learner's step reports the same."""
    rng = np.random.default_rng(4)
    samples = [_sample(rng, int(rng.integers(8, 15)), 5) for _ in range(8)]
    inputs, batch, taken = _pack(samples, rows=4, row_len=32, max_tokens=64)
    assert len(taken) == 8
    model, objective = init_model(cfg, seed=5), ObjectiveConfig()

    def grads(micro_rows):
        loss_fn = lambda m: loss_and_metrics(m, inputs, batch, objective, micro_rows)[0]
        loss, g = nnx.jit(nnx.value_and_grad(loss_fn))(model)
        return float(loss), np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])

    # The loss is a sum of signed advantage-weighted terms of order 1 that cancel to a few
    # hundredths, so fp32 summation order moves it by ulps of the terms (~5e-8, seen at XLA's -O0),
    # more than 1e-6 of the small total: an absolute floor of 1e-7 beside the relative bound.
    loss0, g0 = grads(None)
    for micro_rows in (2,):
        loss, g = grads(micro_rows)
        assert loss == pytest.approx(loss0, rel=1e-6, abs=1e-7)
        assert np.linalg.norm(g - g0) <= 1e-6 * np.linalg.norm(g0)
    steps = [Learner(init_model(cfg, seed=5), OptimizerConfig(), objective, micro_rows=m).step(inputs, batch)
             for m in (None, 2)]
    assert steps[1].loss == pytest.approx(steps[0].loss, rel=1e-6, abs=1e-7)
    assert steps[1].grad_norm == pytest.approx(steps[0].grad_norm, rel=1e-6)
    with pytest.raises(ValueError, match="micro_rows"):
        Learner(init_model(CFG), OptimizerConfig(), ObjectiveConfig(), micro_rows=3).step(inputs, batch)
