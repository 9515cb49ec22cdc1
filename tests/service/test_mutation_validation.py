"""Validation edges a mutation run of ``trainer_jax/service/validation.py`` found untested (issue 37):
a sampled token past every id of the last support row, and the record's byte size, which the
service's buffer bound counts."""

import numpy as np
import pytest
from fakes import fake_trajectory

from mixrl_wire import pb
from mixrl_wire.arrays import decode, encode
from trainer_jax.service.validation import ValidationContext, ValidationError, validate_trajectory

V, K = 50, 4


def _msg(truncated: bool, seed: int = 0, *, head_k: int = K, version: int = 1) -> pb.Trajectory:
    task = pb.Task(lease_id="L", task_id=7, sample_indices=[0], group_size=1, prompt_ids=[1, 2],
                   sampling=pb.SamplingParams(temperature=1.0, top_p=0.8 if truncated else 1.0,
                                              top_k=8 if truncated else 0, head_k=head_k, max_new_tokens=8))
    return fake_trajectory(task, 0, V, np.random.default_rng(seed), n_tokens=5, version=version, env_tokens=2)


def _ctx(truncated: bool, *, head_k: int = K, max_support: int | None = None) -> ValidationContext:
    return ValidationContext(vocab_size=V, head_k=head_k, truncation=truncated, max_tokens=64,
                             max_policy_tokens=8, current_version=3, max_support=max_support)


def _refused(msg, ctx) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        validate_trajectory(msg, ctx)
    return info.value


def _get(msg, field, dtype):
    a = getattr(msg, field)
    return decode(a, field, dtype, len(a.shape)).copy()


def test_a_sampled_token_beyond_its_whole_support_is_named():
    msg = _msg(truncated=True)
    rec = validate_trajectory(msg, _ctx(True))
    indptr, p = rec.support_indptr, rec.num_policy_tokens
    ids, tokens = _get(msg, "support_ids", "int32"), _get(msg, "token_ids", "int32")
    last = slice(int(indptr[p - 1]), int(indptr[p]))
    ids[last] = np.arange(last.stop - last.start)  # the last row: ids 0.., none of them V - 1
    tokens[np.nonzero(rec.loss_mask)[0][-1]] = V - 1  # sampled: larger than every key
    encode(ids, "int32", msg.support_ids)
    encode(tokens, "int32", msg.token_ids)
    with pytest.raises(ValidationError) as info:
        validate_trajectory(msg, _ctx(True))
    assert info.value.field == "support_ids"
    assert f"the sampled token {V - 1} at policy position {p - 1} is not in its support" in str(info.value)


@pytest.mark.parametrize("truncated", [False, True])
def test_the_record_counts_its_bytes(truncated):
    rec = validate_trajectory(_msg(truncated, seed=3), _ctx(truncated))
    arrays = [rec.token_ids, rec.loss_mask, rec.logprobs, rec.logprobs_full, rec.versions, rec.head_ids,
              rec.head_logprobs]
    if truncated:
        arrays += [rec.support_indptr, rec.support_ids, rec.support_logprobs]
    assert rec.nbytes == 512 + sum(a.nbytes for a in arrays)
    assert rec.nbytes < 2048  # a few hundred bytes of arrays: not a shifted or multiplied count


def test_the_current_version_is_accepted_the_next_is_from_the_future():
    assert (validate_trajectory(_msg(False, version=3), _ctx(False)).versions == 3).all()
    e = _refused(_msg(False, version=4), _ctx(False))
    assert e.field == "versions" and "version 4 is from the future (latest published is 3)" in str(e)


def test_a_head_of_two_with_a_repeat_and_an_unsorted_head_are_refused():
    msg = _msg(False, head_k=2)
    validate_trajectory(msg, _ctx(False, head_k=2))
    ids = _get(msg, "head_ids", "int32")
    ids[1, 1] = ids[1, 0]
    encode(ids, "int32", msg.head_ids)
    assert _refused(msg, _ctx(False, head_k=2)).field == "head_ids"
    # descending except one pair below the first entry: [-1, -3, -2, -4]
    msg = _msg(False)
    lp = _get(msg, "head_logprobs", "float32")
    lp[0] = [-1.0, -3.0, -2.0, -4.0]
    encode(lp, "float32", msg.head_logprobs)
    e = _refused(msg, _ctx(False))
    assert e.field == "head_logprobs" and "sorted by descending logprob" in str(e)


def test_kept_sets_up_to_max_support_are_accepted_wider_ones_refused():
    msg = _msg(True, seed=4)
    rec = validate_trajectory(msg, _ctx(True))
    widest = int(np.diff(rec.support_indptr).max())
    for limit in (widest, widest + 1, 64):
        validate_trajectory(msg, _ctx(True, max_support=limit))
    assert _refused(msg, _ctx(True, max_support=widest - 1)).field == "support_indptr"
