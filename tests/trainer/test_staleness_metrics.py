"""The per-token staleness shares (issue 34): ``staleness/0``, ``staleness/1``, ``staleness/2plus``
are the shares of trained tokens 0, 1 and 2+ versions behind the trainer, from each token's own
version, so one partial rollout's tokens fall in several; overall and per sampler group."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer_jax.batching import Sample, pack
from trainer_jax.objective import ObjectiveConfig, reduce_metrics
from trainer_jax.objective.loss import policy_loss

VOCAB, DIM = 50, 8


def _sample(rng, prompt: int, versions: list[int], group: int) -> Sample:
    p = len(versions)
    length = prompt + p
    mask = np.zeros(length, np.int32)
    mask[prompt:] = 1
    return Sample(token_ids=rng.integers(0, VOCAB, length).astype(np.int32), loss_mask=mask,
                  logprobs=np.full(p, -3.9, np.float32),
                  head_ids=np.tile(np.arange(4, dtype=np.int32), (p, 1)),
                  head_logprobs=np.full((p, 4), -3.9, np.float32),
                  support_indptr=np.zeros(p + 1, np.int32), support_ids=np.zeros(0, np.int32),
                  support_logprobs=np.zeros(0, np.float32), versions=np.asarray(versions, np.int32),
                  group=group)


def test_staleness_shares_count_each_token_at_its_own_version():
    rng = np.random.default_rng(0)
    # Trainer at version 5. A partial rollout spanning versions 3 -> 4 -> 5 (2, 1 and 0 behind),
    # a fresh sample, and one three versions behind, in two sampler groups.
    samples = [_sample(rng, 3, [3, 3, 4, 4, 4, 5], group=0), _sample(rng, 2, [5, 5, 5, 5], group=1),
               _sample(rng, 4, [2, 2], group=1)]
    inputs, batch, taken = pack(samples, np.array([1.0, -1.0, 0.5]), rows=2, row_len=16,
                                max_tokens=32, head_k=4, support_k=4, temperature=1.0,
                                trainer_version=5)
    assert taken == [0, 1, 2]
    hidden = jnp.asarray(rng.normal(size=(32, DIM)), jnp.float32)  # the learner's metric function
    lm_head = jnp.asarray(rng.normal(size=(DIM, VOCAB)), jnp.float32)  # on any policy's states
    _, metrics = jax.jit(policy_loss, static_argnums=3)(hidden, lm_head, batch,
                                                        ObjectiveConfig(num_groups=2))
    m = {k: np.asarray(v) for k, v in reduce_metrics(metrics).items()}
    # 12 tokens: behind 0 -> 1 + 4, behind 1 -> 3, behind 2+ -> 2 + 2
    assert m["staleness/0"] == pytest.approx(5 / 12)
    assert m["staleness/1"] == pytest.approx(3 / 12)
    assert m["staleness/2plus"] == pytest.approx(4 / 12)
    assert m["staleness"] == pytest.approx((2 * 2 + 3 * 1 + 2 * 3) / 12)
    np.testing.assert_allclose(m["group/staleness/0"], [1 / 6, 4 / 6])
    np.testing.assert_allclose(m["group/staleness/1"], [3 / 6, 0.0])
    np.testing.assert_allclose(m["group/staleness/2plus"], [2 / 6, 2 / 6])
