"""The service's fast validation path agrees with the reference on good and bad records.

``validate_trajectory`` clears a good record with ``_validate_fast`` (fused passes) and hands
anything else to ``validate_trajectory_reference``. The fast path may defer (return None) on
anything, but whenever it accepts, the reference must accept the same record, and whenever it
refuses, the reference must refuse with the same field and reason. Records here are good ones
(with and without truncation, with environment tokens, heads of K = 0, 1, 2, 5, 20) and each of
them corrupted one field at a time, in every way a field can be wrong, plus random single-value
corruptions of every array.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from fakes import fake_trajectory

from mixrl_wire import pb
from mixrl_wire.fastpath import decode_trajectory
from mixrl_wire.sampling import SamplingParams
from trainer_jax.service.validation import (
    LOGPROB_TOL,
    ValidationContext,
    ValidationError,
    _validate_fast,
    validate_trajectory,
    validate_trajectory_reference,
)

VOCAB = 300
ARRAYS = {"token_ids": np.int32, "loss_mask": np.uint8, "logprobs": np.float32, "logprobs_full": np.float32,
          "versions": np.int32, "head_ids": np.int32, "head_logprobs": np.float32,
          "support_indptr": np.int32, "support_ids": np.int32, "support_logprobs": np.float32}


def _good(k: int, truncated: bool, seed: int, env_tokens: int = 0,
          n: int = 12) -> tuple[pb.Trajectory, ValidationContext]:
    sampling = SamplingParams(max_new_tokens=64, head_k=k, top_p=0.9 if truncated else 1.0)
    task = pb.Task(lease_id="lease", task_id=3, sample_indices=[0], sampling=sampling.to_pb())
    msg = fake_trajectory(task, 0, VOCAB, np.random.default_rng(seed), n_tokens=n, version=2,
                          env_tokens=env_tokens)
    msg.session_id = "s"
    ctx = ValidationContext(vocab_size=VOCAB, head_k=k, truncation=truncated, max_tokens=1000,
                            max_policy_tokens=64, current_version=2, max_support=None)
    return msg, ctx


def _get(msg: pb.Trajectory, field: str) -> np.ndarray:
    a = getattr(msg, field)
    return np.frombuffer(a.data, ARRAYS[field]).reshape(tuple(a.shape)).copy()


def _set(msg: pb.Trajectory, field: str, x: np.ndarray, dtype=None) -> pb.Trajectory:
    out = pb.Trajectory()
    out.CopyFrom(msg)
    x = np.ascontiguousarray(x, dtype or ARRAYS[field])
    a = getattr(out, field)
    a.shape[:] = x.shape
    a.data = x.tobytes()
    return out


def _verdict(fn, msg, ctx):
    try:
        rec = fn(msg, ctx)
    except ValidationError as e:
        return ("refused", e.field, e.reason)
    return ("deferred",) if rec is None else ("accepted", rec)


def _same_record(a, b) -> None:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            assert (x is None) == (y is None), f.name
            if x is not None:
                assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), f.name
        else:
            assert x == y or (x != x and y != y), f.name


def _agree(msg: pb.Trajectory, ctx: ValidationContext, name: str = "") -> tuple:
    """Both paths on the received bytes (as the service sees them); returns the reference's verdict."""
    wire = decode_trajectory(msg.SerializeToString())
    ref = _verdict(validate_trajectory_reference, wire, ctx)
    fast = _verdict(_validate_fast, wire, ctx)
    full = _verdict(validate_trajectory, wire, ctx)
    assert ref[0] != "deferred"
    if fast[0] == "accepted":
        assert ref[0] == "accepted", (name, fast, ref)
        _same_record(fast[1], ref[1])
    elif fast[0] == "refused":
        assert fast == ref, name
    assert full[0] == ref[0], name
    if ref[0] == "refused":
        assert full == ref
    else:
        _same_record(full[1], ref[1])
    return ref


CASES = [(k, truncated) for k in (0, 1, 2, 5, 20) for truncated in (False, True)]


@pytest.mark.parametrize("k,truncated", CASES)
def test_good_records_take_the_fast_path(k, truncated):
    for seed in range(3):
        for env_tokens in (0, 3):
            msg, ctx = _good(k, truncated, seed, env_tokens)
            assert _agree(msg, ctx)[0] == "accepted"
            wire = decode_trajectory(msg.SerializeToString())
            assert _validate_fast(wire, ctx) is not None  # a good record is not deferred


def _corruptions(msg: pb.Trajectory, ctx: ValidationContext, rng: np.random.Generator):
    """(name, message, context): one field wrong, in each way it can be."""
    k = ctx.head_k
    tokens, mask = _get(msg, "token_ids"), _get(msg, "loss_mask")
    p = int(mask.sum())
    nan, inf = np.float32(np.nan), np.float32(np.inf)
    yield "ctx: too many tokens", msg, dataclasses.replace(ctx, max_tokens=len(tokens) - 1)
    yield "ctx: too many policy tokens", msg, dataclasses.replace(ctx, max_policy_tokens=p - 1)
    yield "ctx: version from the future", msg, dataclasses.replace(ctx, current_version=1)
    for field in ARRAYS:
        if not msg.HasField(field):
            continue
        x = _get(msg, field)
        out = pb.Trajectory()
        out.CopyFrom(msg)
        out.ClearField(field)
        yield f"{field}: missing", out, ctx
        yield f"{field}: wrong dtype", _set(msg, field, x, np.int64 if x.dtype != np.int64 else np.int32), ctx
        other_rank = x.reshape(1, -1) if x.ndim == 1 else x.reshape(-1)
        yield f"{field}: wrong rank", _set(msg, field, other_rank), ctx
        bad = _set(msg, field, x)
        getattr(bad, field).data = getattr(bad, field).data + b"\0" * x.itemsize
        yield f"{field}: byte count", bad, ctx
        flat = x.reshape(-1)
        if flat.size:
            yield f"{field}: one short", _set(msg, field, flat[:-1] if x.ndim == 1 else x[:-1]), ctx
        if x.dtype == np.float32 and flat.size:
            for value in (nan, inf, -inf, np.float32(0.1), np.float32(LOGPROB_TOL),
                          np.float32(2 * LOGPROB_TOL), np.float32(-3e38)):
                for pos in {0, flat.size // 2, flat.size - 1}:
                    y = flat.copy()
                    y[pos] = value
                    yield f"{field}: {value} at {pos}", _set(msg, field, y.reshape(x.shape)), ctx
        if x.dtype == np.int32 and flat.size:
            for value in (-1, VOCAB - 1, VOCAB, 2**31 - 1, -2**31, 0, 3):
                for pos in {0, flat.size // 2, flat.size - 1}:
                    y = flat.copy()
                    y[pos] = value
                    yield f"{field}: {value} at {pos}", _set(msg, field, y.reshape(x.shape)), ctx
    yield "loss_mask: a 2", _set(msg, "loss_mask", np.where(mask == 1, 2, mask)), ctx
    yield "loss_mask: no policy tokens", _set(msg, "loss_mask", np.zeros_like(mask)), ctx
    yield "token_ids: empty", _set(msg, "token_ids", tokens[:0]), ctx
    versions = _get(msg, "versions")
    if p > 1:
        v = versions.copy()
        v[: p // 2] = 2
        v[p // 2:] = 1
        yield "versions: decreasing", _set(msg, "versions", v), ctx
        yield "versions: increasing", _set(msg, "versions", np.minimum(np.arange(p), 2)), ctx
    if k > 1:
        ids, lp = _get(msg, "head_ids"), _get(msg, "head_logprobs")
        for a, b in [(0, 1), (0, k - 1), (k // 2, k - 1), (1, k // 2)]:
            if a != b:
                y = ids.copy()
                row = int(rng.integers(p))
                y[row, b] = y[row, a]
                yield f"head_ids: repeat {a},{b}", _set(msg, "head_ids", y), ctx
                y = ids.copy()
                y[row, b] = y[row, a] + 65536  # the same low 16 bits, a different id (out of range)
                yield f"head_ids: low bits {a},{b}", _set(msg, "head_ids", y), ctx
        y = lp.copy()
        y[0, [0, 1]] = y[0, [1, 0]]
        yield "head_logprobs: unsorted", _set(msg, "head_logprobs", y), ctx
        y = lp.copy()
        y[:, 0] = np.inf
        yield "head_logprobs: +inf first", _set(msg, "head_logprobs", y), ctx
        y = lp.copy()
        y[:, -1] = -np.inf
        yield "head_logprobs: -inf last", _set(msg, "head_logprobs", y), ctx
        y = lp.copy()
        y[-1, :] = 0.0
        yield "head_logprobs: ties", _set(msg, "head_logprobs", y), ctx
    if ctx.truncation:
        yield "support: too large a kept set", msg, dataclasses.replace(ctx, max_support=1)
        indptr = _get(msg, "support_indptr")
        y = indptr.copy()
        y[1] = y[0]
        yield "support_indptr: empty row", _set(msg, "support_indptr", y), ctx
        y = indptr + 1
        yield "support_indptr: start", _set(msg, "support_indptr", y), ctx
    else:
        yield ("support present without truncation", _set(msg, "support_ids", np.arange(3)), ctx)
    for reward in (np.nan, np.inf, 2e6, -2e6, 0.5):
        out = pb.Trajectory()
        out.CopyFrom(msg)
        out.reward = reward
        yield f"reward {reward}", out, ctx
    for text in ("x" * 65, "a\nb", "stop"):
        out = pb.Trajectory()
        out.CopyFrom(msg)
        out.finish_reason = text
        yield f"finish_reason {text!r}", out, ctx
    for q in (-1.0, np.inf, np.nan):
        out = pb.Trajectory()
        out.CopyFrom(msg)
        out.timings.queue_ms = q
        yield f"queue_ms {q}", out, ctx
    for parts in ([("ok", 1.0), ("ok", 2.0)], [("bad name", 1.0)], [("x", np.inf)],
                  [(f"p{i}", 0.0) for i in range(17)]):
        out = pb.Trajectory()
        out.CopyFrom(msg)
        for name, value in parts:
            out.reward_parts.add(name=name, value=value)
        yield f"reward_parts {parts[:2]}", out, ctx


@pytest.mark.parametrize("k,truncated", CASES)
def test_every_kind_of_bad_field_gets_the_reference_verdict(k, truncated):
    rng = np.random.default_rng(k + 100 * truncated)
    refused = set()
    for env_tokens in (0, 2):
        msg, ctx = _good(k, truncated, seed=k, env_tokens=env_tokens)
        for name, bad, bad_ctx in _corruptions(msg, ctx, rng):
            ref = _agree(bad, bad_ctx, name)
            if ref[0] == "refused":
                refused.add(ref[1])
    # The corruptions reach every array the task has (a sanity check on this test itself).
    want = {"token_ids", "loss_mask", "logprobs", "logprobs_full", "versions", "reward", "finish_reason",
            "timings.queue_ms", "reward_parts"}
    if k:
        want |= {"head_ids", "head_logprobs"}
    want |= {"support_indptr", "support_ids", "support_logprobs"} if truncated else {"support_ids"}
    assert want <= refused, want - refused


def test_random_single_value_corruptions_agree():
    rng = np.random.default_rng(7)
    specials = [np.nan, np.inf, -np.inf, 0.0, LOGPROB_TOL, 1.0, -1e30, -1, VOCAB, 2**31 - 1, -2**31, 65536,
                1, 2]
    for trial in range(300):
        k = int(rng.choice([1, 2, 3, 8, 20]))
        truncated = bool(rng.integers(2))
        msg, ctx = _good(k, truncated, seed=trial, env_tokens=int(rng.integers(3)), n=int(rng.integers(1, 9)))
        fields = [f for f in ARRAYS if msg.HasField(f) and len(getattr(msg, f).data)]
        field = fields[int(rng.integers(len(fields)))]
        x = _get(msg, field).reshape(-1)
        value = specials[int(rng.integers(len(specials)))]
        if x.dtype != np.float32 and not (isinstance(value, int) or float(value).is_integer()):
            continue
        with np.errstate(invalid="ignore", over="ignore"):
            x[int(rng.integers(x.size))] = np.asarray(value).astype(x.dtype)
        _agree(_set(msg, field, x.reshape(_get(msg, field).shape)), ctx)


def test_head_repeats_whose_low_16_bits_agree():
    """The rotations compare low 16 bits first; ids equal there but not in full are not repeats."""
    from trainer_jax.service.validation import _rows_have_repeats

    rng = np.random.default_rng(3)
    for k in (2, 3, 7, 20):
        for _ in range(40):
            base = rng.integers(0, 4, size=(5, k))
            ids = (base * 65536 + rng.integers(0, 3, size=(5, k))).astype(np.int32)
            want = any(len(set(row.tolist())) < k for row in ids)
            assert _rows_have_repeats(ids) == want
        distinct = (np.arange(k, dtype=np.int32) * 65536)[None, :].repeat(4, axis=0)  # all low bits 0
        assert not _rows_have_repeats(distinct)
        distinct[2, -1] = distinct[2, 0]
        assert _rows_have_repeats(distinct)


def test_a_field_number_beyond_protobufs_range_is_left_to_the_runtime():
    """A tag whose field number exceeds 2**29 - 1 (found by test_fastpath's hypothesis search):
    protobuf refuses the message, so the fast decoder must defer rather than skip it."""
    from google.protobuf.message import DecodeError

    from mixrl_wire.fastpath import parse_trajectory

    data = b"\xc5\x80\x80\x80\x10\x00\x00\x00\x00"  # tag (2**29 + 8) << 3 | 5, four bytes of fixed32
    assert parse_trajectory(data) is None
    with pytest.raises(DecodeError):
        decode_trajectory(data)


# ----- the reference at its boundaries (mutants the fast path's acceptance hid, issue 46) -------


def test_a_record_of_exactly_max_tokens_is_judged_on_its_own_faults_not_its_length():
    msg, ctx = _good(5, False, seed=1)
    n = len(_get(msg, "token_ids"))
    at_limit = dataclasses.replace(ctx, max_tokens=n)
    assert _agree(msg, at_limit)[0] == "accepted"  # exactly the limit is allowed, on both paths
    assert _verdict(validate_trajectory_reference, decode_trajectory(msg.SerializeToString()),
                    at_limit)[0] == "accepted"
    # A record at the limit with another fault goes to the reference, which names that fault.
    versions = _get(msg, "versions")
    versions[-1] = -1
    ref = _agree(_set(msg, "versions", versions), at_limit)
    assert ref[:2] == ("refused", "versions"), ref


def test_a_version_that_falls_below_its_neighbour_but_not_below_the_first_is_refused():
    msg, ctx = _good(2, False, seed=2)
    p = len(_get(msg, "versions"))
    versions = np.zeros(p, np.int32)
    versions[p // 2:] = 2
    versions[-1] = 1  # 0 ... 0 2 ... 2 1: never below the first, yet it decreases
    ref = _agree(_set(msg, "versions", versions), ctx)
    assert ref == ("refused", "versions", "versions must not decrease along the trajectory"), ref


def test_kept_sets_of_one_token_each_are_accepted():
    # top_p small enough that every kept set is the sampled token alone: offsets 0, 1, ..., P.
    msg, ctx = _good(0, True, seed=3)
    sampled = _get(msg, "token_ids")[_get(msg, "loss_mask").astype(bool)]
    p = len(sampled)
    msg = _set(msg, "support_indptr", np.arange(p + 1))
    msg = _set(msg, "support_ids", sampled)
    msg = _set(msg, "support_logprobs", np.zeros(p))
    assert _agree(msg, ctx)[0] == "accepted"
    assert _verdict(validate_trajectory_reference, decode_trajectory(msg.SerializeToString()),
                    ctx)[0] == "accepted"


def test_token_ids_without_a_shape_get_the_references_verdict():
    # An array sent with no shape (a scalar's []) is refused as not of rank 1; the fast path
    # must defer to that, not take a length from nowhere.
    msg, ctx = _good(0, False, seed=4)
    scalar = _set(msg, "token_ids", np.asarray([7], np.int32))
    del scalar.token_ids.shape[:]  # no shape at all on the wire
    ref = _agree(scalar, ctx)
    assert ref == ("refused", "token_ids", "must have rank 1, got shape []"), ref


def test_two_policy_tokens_whose_versions_decrease_are_refused():
    msg, ctx = _good(1, False, seed=5, n=2)
    assert len(_get(msg, "versions")) == 2
    ref = _agree(_set(msg, "versions", np.asarray([2, 1])), ctx)
    assert ref == ("refused", "versions", "versions must not decrease along the trajectory"), ref


def test_a_kept_set_over_support_k_is_named_by_its_own_position_not_an_earlier_full_one():
    # max_support 2: the kept set at position 0 holds exactly 2 ids (allowed), the one at position 1
    # holds 3. The refusal names position 1.
    msg, ctx = _good(0, True, seed=6, n=3)
    sampled = _get(msg, "token_ids")[_get(msg, "loss_mask").astype(bool)]
    assert len(sampled) == 3
    rows = [[sampled[0], (sampled[0] + 1) % VOCAB],
            [sampled[1], (sampled[1] + 1) % VOCAB, (sampled[1] + 2) % VOCAB],
            [sampled[2]]]
    msg = _set(msg, "support_indptr", np.cumsum([0] + [len(r) for r in rows]))
    msg = _set(msg, "support_ids", np.concatenate(rows))
    msg = _set(msg, "support_logprobs", np.full(sum(map(len, rows)), -1.0))
    ref = _agree(msg, dataclasses.replace(ctx, max_support=2))
    assert ref == ("refused", "support_indptr",
                   "the kept set at policy position 1 has 3 ids, more than train.support_k = 2"), ref
