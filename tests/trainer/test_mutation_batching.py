"""Packing at its boundaries (issue 37): the bugs a mutation run of ``trainer_jax/batching.py`` showed
the other tests would let through. A sample that exactly fills a row must be packed: when
``row_len`` equals prompt + ``max_new_tokens`` every response cut at the length limit is one."""

from __future__ import annotations

import re

import numpy as np
import pytest

from trainer_jax.batching import RowPacker, Sample, pack, pack_sequences


def _sample(length: int, policy: int, *, first: int = 1, group: int = 0, version: int = 0,
            support: int = 0) -> Sample:
    """``length`` tokens (ids ``first..``), the last ``policy`` of them sampled by the policy."""
    ids = np.arange(first, first + length, dtype=np.int32)
    mask = np.zeros(length, np.int32)
    mask[length - policy:] = 1
    indptr = np.arange(policy + 1, dtype=np.int32) * support
    return Sample(token_ids=ids, loss_mask=mask, logprobs=-np.arange(1, policy + 1, dtype=np.float32),
                  head_ids=np.tile(np.arange(3, dtype=np.int32), (policy, 1)),
                  head_logprobs=np.full((policy, 3), -1.5, np.float32), support_indptr=indptr,
                  support_ids=np.arange(policy * support, dtype=np.int32) + 7,
                  support_logprobs=np.full(policy * support, -0.5, np.float32),
                  versions=np.full(policy, version, np.int32), group=group)


def _pack(samples, advantages=None, **kw):
    args = dict(rows=2, row_len=32, max_tokens=64, head_k=3, support_k=2, temperature=1.0,
                trainer_version=0)
    args.update(kw)
    adv = np.arange(1, len(samples) + 1, dtype=np.float32) if advantages is None else advantages
    return pack(samples=samples, advantages=adv, **args)  # every parameter by keyword too


def test_a_sample_that_exactly_fills_a_row_is_packed():
    samples = [_sample(32, 8), _sample(16, 4, first=100), _sample(16, 4, first=200)]
    inputs, batch, taken = _pack(samples)
    assert taken == [0, 1, 2]
    rows, cols = np.asarray(inputs.token_rows), np.asarray(inputs.token_cols)
    # sample 0 fills row 0; samples 1 and 2 share row 1, one after the other
    assert rows[:16].tolist() == [0] * 8 + [1] * 8
    assert cols[:8].tolist() == list(range(23, 31))  # the state before each policy token
    assert cols[8:16].tolist() == list(range(11, 15)) + list(range(27, 31))
    ids = np.asarray(inputs.input_ids)
    assert ids[0].tolist() == list(range(1, 33))
    assert ids[1].tolist() == list(range(100, 116)) + list(range(200, 216))
    seg = np.asarray(inputs.segment_ids)
    assert seg[0].tolist() == [1] * 32 and seg[1].tolist() == [1] * 16 + [2] * 16
    pos = np.asarray(inputs.positions)
    assert pos[1].tolist() == list(range(16)) * 2
    # the policy tokens are the ones each state predicts
    assert np.asarray(batch.token_ids)[:16].tolist() == (list(range(25, 33)) + list(range(112, 116))
                                                          + list(range(212, 216)))
    assert np.asarray(batch.loss_mask).tolist() == [1.0] * 16 + [0.0] * 48
    assert np.asarray(batch.seq_ids)[:16].tolist() == [0] * 8 + [1] * 4 + [2] * 4
    assert np.asarray(batch.advantages)[:16].tolist() == [1.0] * 8 + [2.0] * 4 + [3.0] * 4


def test_rows_and_tokens_that_are_full_leave_the_rest_for_later():
    samples = [_sample(20, 4), _sample(20, 4), _sample(12, 4), _sample(20, 4)]
    _, _, taken = _pack(samples)
    assert taken == [0, 1, 2]  # 12 fits beside the first 20; the last 20 has no row left
    # exactly max_tokens policy tokens fit; one more does not
    _, batch, taken = _pack([_sample(10, 8), _sample(10, 8)], max_tokens=16)
    assert taken == [0, 1] and np.asarray(batch.loss_mask).sum() == 16
    _, _, taken = _pack([_sample(10, 8), _sample(10, 9), _sample(4, 2)], max_tokens=16)
    assert taken == [0, 2]  # the second overflows the token budget; a later one still fits


def test_a_sequence_longer_than_a_row_is_an_error():
    with pytest.raises(ValueError, match="33 tokens is longer than row_len=32"):
        _pack([_sample(33, 4)])
    packer = RowPacker(1, 8)
    assert packer.place(np.arange(8)) == (0, 0)
    assert packer.place(np.arange(1)) is None


def test_pack_sequences_takes_a_sequence_that_exactly_fills_a_row():
    seqs = [(list(range(1, 33)), [0] * 31 + [1]), (list(range(40, 56)), [0] * 8 + [1] * 8)]
    inputs, targets, mask, count = pack_sequences(seqs, rows=2, row_len=32, max_tokens=9)
    assert count == 2
    assert targets.tolist() == [32] + list(range(48, 56)) and mask.tolist() == [1.0] * 9
    assert np.asarray(inputs.token_rows).tolist() == [0] + [1] * 8
    assert np.asarray(inputs.token_cols).tolist() == [30] + list(range(7, 15))
    # one target more than max_tokens stops the packing before that sequence
    _, _, mask, count = pack_sequences(seqs, rows=2, row_len=32, max_tokens=8)
    assert count == 1 and mask.sum() == 1


def test_staleness_support_and_heads_are_copied_per_token():
    samples = [_sample(6, 2, version=1, support=2, group=3), _sample(6, 2, version=4)]
    _, batch, taken = _pack(samples, head_k=2, max_tokens=4, trainer_version=5, max_staleness=2)
    assert taken == [0, 1]
    # version 1 is 4 behind version 5 (> 2): masked; version 4 is 1 behind: trained
    assert np.asarray(batch.loss_mask).tolist() == [0.0, 0.0, 1.0, 1.0]
    assert np.asarray(batch.versions).tolist() == [1, 1, 4, 4]
    assert np.asarray(batch.group_ids).tolist() == [3, 3, 0, 0]
    assert np.asarray(batch.head_ids).tolist() == [[0, 1]] * 4  # head_k=2 of the sample's 3
    assert np.asarray(batch.support_ids).tolist() == [[7, 8], [9, 10], [-1, -1], [-1, -1]]
    inf = float("-inf")  # padding: no support kept (truncation off), no head entry
    assert np.asarray(batch.support_logprobs).tolist() == [[-0.5, -0.5]] * 2 + [[inf, inf]] * 2
    _, wide, _ = _pack(samples, head_k=4, max_tokens=4)
    assert np.asarray(wide.head_ids)[:, 3].tolist() == [-1] * 4
    assert np.asarray(wide.head_logprobs)[:, 3].tolist() == [inf] * 4
    assert np.asarray(batch.behavior_logprob).tolist() == [-1.0, -2.0, -1.0, -2.0]
    # exactly max_staleness behind is still trained
    _, batch, _ = _pack([_sample(6, 2, version=3)], max_tokens=2, trainer_version=5, max_staleness=2)
    assert np.asarray(batch.loss_mask).tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="support of 2 ids exceeds support_k=1"):
        _pack([_sample(6, 2, support=2)], support_k=1)
    wide_support = _sample(6, 2, support=2)
    wide_support.support_indptr = np.array([0, 1, 4], np.int32)  # token 1 keeps 3 ids
    with pytest.raises(ValueError, match="^sample 1 token 1: support of 3 ids exceeds support_k=2$"):
        _pack([_sample(6, 2), wide_support], support_k=2)


def _record(policy: int, *, support: bool, reward: float | None = 0.5):
    from trainer_jax.service.validation import TrajectoryRecord

    nnz = 2 * policy if support else 0
    return TrajectoryRecord(
        task_id=7, sample_index=2, token_ids=np.arange(10, 10 + policy + 1, dtype=np.int32),
        loss_mask=np.array([1] * policy + [0], np.uint8), logprobs=np.full(policy, -0.25, np.float32),
        logprobs_full=np.full(policy, -0.25, np.float32), versions=np.full(policy, 3, np.int32),
        head_ids=np.zeros((policy, 2), np.int32), head_logprobs=np.zeros((policy, 2), np.float32),
        support_indptr=np.arange(policy + 1, dtype=np.int32) * 2 if support else None,
        support_ids=np.arange(nnz, dtype=np.int32) if support else None,
        support_logprobs=np.full(nnz, -0.7, np.float32) if support else None,
        reward=reward, sampler_reward=None, finish_reason="stop", queue_ms=0.0, generate_ms=0.0, nbytes=0)


def test_from_record_puts_the_prompt_first_and_fills_an_absent_support():
    s = Sample.from_record(_record(3, support=False), [1, 2], group_index=4)
    assert s.token_ids.tolist() == [1, 2, 10, 11, 12, 13] and s.loss_mask.tolist() == [0, 0, 1, 1, 1, 0]
    assert s.support_indptr.tolist() == [0, 0, 0, 0]
    assert s.support_ids.shape == (0,) and s.support_ids.dtype == np.int32
    assert s.support_logprobs.shape == (0,) and s.support_logprobs.dtype == np.float32
    assert (s.reward, s.group, s.task_id, s.sample_index) == (0.5, 4, 7, 2)
    kept = Sample.from_record(_record(3, support=True, reward=None), [1], group_index=0)
    assert kept.support_indptr.tolist() == [0, 2, 4, 6] and kept.support_ids.tolist() == list(range(6))
    assert kept.support_logprobs.tolist() == [pytest.approx(-0.7)] * 6 and kept.reward == 0.0


def test_long_samples_are_checked_by_value():
    # 300 policy tokens: past the small integers CPython caches (an identity test would differ)
    s = _sample(301, 300)
    assert s.num_policy_tokens == 300
    assert (s.reward, s.group, s.task_id, s.sample_index) == (0.0, 0, 0, 0)  # the defaults
    with pytest.raises(ValueError, match="support_indptr must have policy tokens \\+ 1 entries"):
        Sample(**{**s.__dict__, "support_indptr": np.zeros(300, np.int32)})
    with pytest.raises(ValueError, match="logprobs has 299 entries for 300 policy tokens"):
        Sample(**{**s.__dict__, "logprobs": np.zeros(299, np.float32)})


def test_pack_sequences_masks_exactly_each_sequences_targets():
    seqs = [([1, 2, 3, 4], [0, 1, 1, 1])] * 3  # 3 targets each: the second starts at n=3
    inputs, targets, mask, count = pack_sequences(seqs, rows=1, row_len=32, max_tokens=10)
    assert count == 3 and mask.tolist() == [1.0] * 9 + [0.0]
    assert targets.tolist() == [2, 3, 4] * 3 + [0]
    assert np.asarray(inputs.token_cols).tolist() == [0, 1, 2, 4, 5, 6, 8, 9, 10, 0]


def test_non_finite_advantages_flags_whole_groups_and_refuses_other_shapes():
    """One flag per prompt group of a [P, G] array (any NaN or inf in the group); any other shape
    is one clear error: a [P, G, 1] array would otherwise give a [P, 1] array of flags (not the
    [P] its callers index groups with) and a flat one numpy's axis error."""
    from trainer_jax.batching import non_finite_advantages

    adv = np.array([[0.5, -0.5], [np.nan, 1.0], [np.inf, 0.0], [1.0, -1.0]], np.float32)
    assert non_finite_advantages(adv).tolist() == [False, True, True, False]
    for bad in (adv[..., None], adv.ravel()):
        shape = re.escape(str(bad.shape))
        with pytest.raises(ValueError, match=rf"^advantages must be \[P, G\], got shape {shape}$"):
            non_finite_advantages(bad)
