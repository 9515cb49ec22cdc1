"""Trajectory validation: every field is checked before a sample can reach a training batch.

``validate_trajectory`` decodes a ``mixrl.v1.Trajectory`` into a ``TrajectoryRecord`` (numpy views
over the message bytes, no copies) or raises ``ValidationError`` whose ``field`` names the first
offending field. All checks are vectorised so a 4,096-token sample with a K=20 head costs well
under a millisecond. Lease and replay checks (is this task leased to this sampler, is the sample
already in) need the service's state and live in ``trainer_jax.service.scheduler``.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from mixrl_wire import pb
from mixrl_wire.arrays import ArrayError, decode_parts
from mixrl_wire.fastpath import WireTrajectory, from_message
from mixrl_wire.reward_parts import MAX_PARTS as MAX_REWARD_PARTS
from mixrl_wire.reward_parts import NAME as REWARD_PART_NAME

# Rounding slack for "log-probabilities are <= 0": log_softmax of a peaked distribution can come
# out at +1e-7 in float32, which is not a malformed record.
LOGPROB_TOL = 1e-5
MAX_FINISH_REASON = 64
#: ``service.limits.max_abs_reward``'s default: a reward beyond it is no score but a fault, and
#: float32 advantages of a group holding 3e38 (finite in float32) come out NaN
MAX_ABS_REWARD = 1e6
#: the reason a reward, reward part or metric beyond the limit (or not finite) is refused with
OUT_OF_RANGE = "out_of_range"


class ValidationError(ValueError):
    """A trajectory is malformed: ``field`` is the offending field, ``reason`` says how."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class ValidationContext:
    """What a trajectory is checked against: the task's parameters and the service's state."""

    vocab_size: int
    head_k: int
    truncation: bool
    max_tokens: int
    max_policy_tokens: int | None
    current_version: int
    # The learner's ``train.support_k``: a larger kept set could not be packed (None: no limit).
    max_support: int | None = None
    # ``service.limits.max_abs_reward``: a reward or reward part beyond it is refused (out_of_range)
    max_abs_reward: float = MAX_ABS_REWARD


@dataclasses.dataclass
class TrajectoryRecord:
    """A validated sample. Per-token arrays are aligned with the ``P`` policy tokens.

    ``support_*`` is ``None`` when truncation was off. ``reward`` is the trainer-side score when
    the task source has one, else what the sampler reported. Sampler fields (``session_id`` ...)
    come from the registered session, never from the message.
    """

    task_id: int
    sample_index: int
    token_ids: np.ndarray        # int32 [T]
    loss_mask: np.ndarray        # uint8 [T]
    logprobs: np.ndarray         # float32 [P]
    logprobs_full: np.ndarray    # float32 [P]
    versions: np.ndarray         # int32 [P]
    head_ids: np.ndarray         # int32 [P, K]
    head_logprobs: np.ndarray    # float32 [P, K]
    support_indptr: np.ndarray | None   # int32 [P+1]
    support_ids: np.ndarray | None      # int32 [nnz]
    support_logprobs: np.ndarray | None  # float32 [nnz]
    reward: float | None
    sampler_reward: float | None
    finish_reason: str
    queue_ms: float
    generate_ms: float
    nbytes: int
    session_id: str = ""
    sampler_name: str = ""
    group: str = ""
    recipe: dict = dataclasses.field(default_factory=dict)
    received_unix: float = 0.0
    reward_parts: dict[str, float] = dataclasses.field(default_factory=dict)  # logged, not trained

    @property
    def num_policy_tokens(self) -> int:
        return int(self.logprobs.shape[0])

    def policy_token_ids(self) -> np.ndarray:
        # A reply with no environment tokens (every single-turn one) is its own policy tokens:
        # no masked copy, the received ids as they are.
        if self.loss_mask.all():
            return self.token_ids
        return self.token_ids[self.loss_mask.astype(bool)]


def _finite_logprobs(field: str, x: np.ndarray) -> None:
    if x.size and not np.isfinite(x).all():
        raise ValidationError(field, "must be finite (no NaN or inf)")
    if x.size and float(x.max()) > LOGPROB_TOL:
        raise ValidationError(field, f"log-probabilities must be <= 0, got max {float(x.max()):.6g}")


def _ids_in_range(field: str, x: np.ndarray, vocab: int) -> None:
    if x.size and (int(x.min()) < 0 or int(x.max()) >= vocab):
        raise ValidationError(field, f"token ids must lie in [0, {vocab}), got range "
                                     f"[{int(x.min())}, {int(x.max())}]")


def _arr(msg: WireTrajectory, field: str, dtype: str, ndim: int) -> np.ndarray:
    a = msg.arrays.get(field)
    if a is None:
        raise ValidationError(field, "missing")
    try:
        return decode_parts(a.dtype, a.shape, a.data, field, dtype, ndim)
    except ArrayError as e:
        raise ValidationError(e.field, str(e).split(": ", 1)[1]) from None


def _expect_shape(field: str, x: np.ndarray, shape: tuple[int, ...]) -> None:
    if x.shape != shape:
        raise ValidationError(field, f"shape {list(x.shape)} does not match the expected {list(shape)}")


def validate_trajectory(msg: pb.Trajectory | WireTrajectory, ctx: ValidationContext) -> TrajectoryRecord:
    """Decode and check ``msg`` against ``ctx``; raise ``ValidationError`` naming the field.

    ``msg``: a protobuf message, or the zero-copy view ``mixrl_wire.fastpath`` decodes on the
    service's hot path (the record's arrays are then views of the received bytes).

    A good record takes ``_validate_fast`` (fewer, fused passes over the arrays); anything it does
    not clear is judged by ``validate_trajectory_reference``, which then names the first offending
    field with the same words as ever. The fast path only ever accepts what the reference accepts
    (tests/service/test_validation_fast.py compares them on good and bad records of every kind).
    """
    if isinstance(msg, pb.Trajectory):
        msg = from_message(msg)
    record = _validate_fast(msg, ctx)
    return record if record is not None else validate_trajectory_reference(msg, ctx)


def validate_trajectory_reference(msg: pb.Trajectory | WireTrajectory,
                                  ctx: ValidationContext) -> TrajectoryRecord:
    """Every check, one at a time, in order: the definition of a valid trajectory and of the
    reason a bad one is refused with (``validate_trajectory`` takes it for anything not clearly
    fine)."""
    if isinstance(msg, pb.Trajectory):
        msg = from_message(msg)
    tokens = _arr(msg, "token_ids", "int32", 1)
    n_tokens = tokens.shape[0]
    if n_tokens == 0:
        raise ValidationError("token_ids", "empty trajectory")
    if n_tokens > ctx.max_tokens:
        raise ValidationError("token_ids", f"{n_tokens} tokens exceed the limit of {ctx.max_tokens}")
    _ids_in_range("token_ids", tokens, ctx.vocab_size)

    mask = _arr(msg, "loss_mask", "uint8", 1)
    _expect_shape("loss_mask", mask, (n_tokens,))
    if int(mask.max()) > 1:
        raise ValidationError("loss_mask", "values must be 0 (environment) or 1 (policy)")
    policy = mask.astype(bool)
    p = int(policy.sum())
    if p == 0:
        raise ValidationError("loss_mask", "no policy tokens")
    if ctx.max_policy_tokens is not None and p > ctx.max_policy_tokens:
        raise ValidationError("loss_mask", f"{p} policy tokens exceed the task's limit of "
                                           f"{ctx.max_policy_tokens}")

    logprobs = _arr(msg, "logprobs", "float32", 1)
    _expect_shape("logprobs", logprobs, (p,))
    _finite_logprobs("logprobs", logprobs)
    logprobs_full = _arr(msg, "logprobs_full", "float32", 1)
    _expect_shape("logprobs_full", logprobs_full, (p,))
    _finite_logprobs("logprobs_full", logprobs_full)

    versions = _arr(msg, "versions", "int32", 1)
    _expect_shape("versions", versions, (p,))
    if int(versions.min()) < 0:
        raise ValidationError("versions", "versions must be >= 0")
    if int(versions.max()) > ctx.current_version:
        raise ValidationError("versions", f"version {int(versions.max())} is from the future (latest "
                                          f"published is {ctx.current_version})")
    if p > 1 and bool((versions[1:] < versions[:-1]).any()):
        raise ValidationError("versions", "versions must not decrease along the trajectory")

    head_ids = _arr(msg, "head_ids", "int32", 2)
    _expect_shape("head_ids", head_ids, (p, ctx.head_k))
    _ids_in_range("head_ids", head_ids, ctx.vocab_size)
    if ctx.head_k > 1 and _rows_have_repeats(head_ids):
        raise ValidationError("head_ids", "ids within a token's head must be unique")
    head_lp = _arr(msg, "head_logprobs", "float32", 2)
    _expect_shape("head_logprobs", head_lp, (p, ctx.head_k))
    _finite_logprobs("head_logprobs", head_lp)
    if ctx.head_k > 1 and bool((head_lp[:, 1:] > head_lp[:, :-1]).any()):
        raise ValidationError("head_logprobs", "each token's head must be sorted by descending logprob")

    sampled = tokens[policy]
    support = _validate_support(msg, ctx, p, sampled)
    return _finish(msg, ctx, (tokens, mask, logprobs, logprobs_full, versions, head_ids, head_lp), support)


def _finish(msg: WireTrajectory, ctx: ValidationContext, arrays: tuple[np.ndarray, ...],
            support: tuple) -> TrajectoryRecord:
    """The scalar fields' checks (the last ones, in order) and the record; shared by both paths."""
    reward = msg.reward
    if reward is not None:
        _in_range("reward", "the reward", reward, ctx.max_abs_reward)
    if len(msg.finish_reason) > MAX_FINISH_REASON or not msg.finish_reason.isprintable():
        raise ValidationError("finish_reason", f"must be printable and at most {MAX_FINISH_REASON} chars")
    for name in ("queue_ms", "generate_ms"):
        v = getattr(msg, name)
        if not math.isfinite(v) or v < 0:
            raise ValidationError(f"timings.{name}", "must be finite and >= 0")
    parts = _reward_parts(msg.reward_parts, ctx.max_abs_reward) if msg.reward_parts else {}
    tokens, mask, logprobs, logprobs_full, versions, head_ids, head_lp = arrays
    return TrajectoryRecord(
        task_id=msg.task_id, sample_index=msg.sample_index, token_ids=tokens, loss_mask=mask,
        logprobs=logprobs, logprobs_full=logprobs_full, versions=versions, head_ids=head_ids,
        head_logprobs=head_lp, support_indptr=support[0], support_ids=support[1],
        support_logprobs=support[2], reward=reward, sampler_reward=reward,
        finish_reason=msg.finish_reason, queue_ms=msg.queue_ms, generate_ms=msg.generate_ms,
        reward_parts=parts,
        nbytes=512 + sum(a.nbytes for a in (*arrays, *(x for x in support if x is not None))))


def _view(msg: WireTrajectory, field: str, dtype: np.dtype, wire_dtype: int, shape: tuple[int, ...]):
    """``field`` as ``dtype`` of exactly ``shape``, or None (missing, another dtype or shape, a
    byte count that does not match): the reference then says which."""
    a = msg.arrays.get(field)
    if a is None or a.dtype != wire_dtype or a.shape != shape:
        return None
    n = dtype.itemsize
    for d in shape:
        n *= d
    if n != len(a.data):
        return None
    return np.frombuffer(a.data, dtype=dtype).reshape(shape)


_I32, _U8, _F32 = np.dtype("<i4"), np.dtype("u1"), np.dtype("<f4")
_NEG_INF = float("-inf")


def _logprobs_fine(x: np.ndarray) -> bool:
    """Finite and <= LOGPROB_TOL, in two reductions: max and min propagate NaN, so a NaN fails
    the first comparison, +inf the first and -inf the second."""
    return x.size == 0 or (float(x.max()) <= LOGPROB_TOL and float(x.min()) > _NEG_INF)


def _validate_fast(msg: WireTrajectory, ctx: ValidationContext) -> TrajectoryRecord | None:
    """The reference's checks on a good record with fewer passes: None as soon as one does not
    clearly pass (the reference then rules). Fused: an id range is one unsigned max (a negative
    int32 is >= 2**31 as uint32); log-probabilities one max and one min; versions one comparison
    (non-decreasing, so the first is the least and the last the greatest); the head's order one
    contiguous comparison over the flattened rows. Why each is exact: the comments by each check.
    """
    a = msg.arrays.get("token_ids")
    if a is None or a.dtype != pb.DTYPE_INT32 or len(a.shape) != 1:
        return None
    n_tokens = a.shape[0]
    if not 0 < n_tokens <= ctx.max_tokens:
        return None
    tokens = _view(msg, "token_ids", _I32, pb.DTYPE_INT32, (n_tokens,))
    if tokens is None or int(tokens.view(np.uint32).max()) >= ctx.vocab_size:
        return None
    mask = _view(msg, "loss_mask", _U8, pb.DTYPE_UINT8, (n_tokens,))
    if mask is None or int(mask.max()) > 1:
        return None
    p = int(np.count_nonzero(mask))  # values are 0 or 1: the count of ones is their sum
    if p == 0 or (ctx.max_policy_tokens is not None and p > ctx.max_policy_tokens):
        return None
    logprobs = _view(msg, "logprobs", _F32, pb.DTYPE_FLOAT32, (p,))
    if logprobs is None or not _logprobs_fine(logprobs):
        return None
    logprobs_full = _view(msg, "logprobs_full", _F32, pb.DTYPE_FLOAT32, (p,))
    if logprobs_full is None or not _logprobs_fine(logprobs_full):
        return None
    versions = _view(msg, "versions", _I32, pb.DTYPE_INT32, (p,))
    # Non-decreasing (p >= 1 here): then versions[0] is the minimum and versions[-1] the maximum.
    if (versions is None or (p > 1 and bool((versions[1:] < versions[:-1]).any()))
            or int(versions[0]) < 0 or int(versions[-1]) > ctx.current_version):
        return None
    k = ctx.head_k
    head_ids = _view(msg, "head_ids", _I32, pb.DTYPE_INT32, (p, k))
    if head_ids is None or (head_ids.size and int(head_ids.view(np.uint32).max()) >= ctx.vocab_size):
        return None
    if k > 1 and _rows_have_repeats(head_ids):
        return None
    head_lp = _view(msg, "head_logprobs", _F32, pb.DTYPE_FLOAT32, (p, k))
    if head_lp is None:
        return None
    if k > 1:
        # One pass for order and NaN: row-major [p, k] flattened, neighbours (t, j), (t, j+1) must
        # satisfy >= (each row's last column against the next row's first is masked out). A NaN
        # fails every comparison and each entry is compared with a neighbour in its row, so a
        # passing head has no NaN and is sorted: its greatest entry is then in column 0 and its
        # least in column k-1, and two reductions over those columns finish the checks.
        flat = head_lp.reshape(-1)
        ordered = flat[:-1] >= flat[1:]
        ordered[k - 1::k] = True
        if not (ordered.all() and float(head_lp[:, 0].max()) <= LOGPROB_TOL
                and float(head_lp[:, k - 1].min()) > _NEG_INF):
            return None
    elif not _logprobs_fine(head_lp):
        return None
    # The kept sets: already one sort and one search over all rows (the reference's own code; it
    # raises the reference's error, since every check before it passed).
    support = (_validate_support(msg, ctx, p, tokens[mask.view(bool)]) if ctx.truncation
               else _validate_support(msg, ctx, p, tokens[:0]))
    return _finish(msg, ctx, (tokens, mask, logprobs, logprobs_full, versions, head_ids, head_lp), support)



def _in_range(field: str, what: str, value: float, limit: float) -> None:
    """``value`` finite and at most ``limit`` in magnitude, else refused as ``out_of_range``."""
    if not math.isfinite(value) or abs(value) > limit:
        raise ValidationError(field, f"{OUT_OF_RANGE}: {what} is {value:.6g}; it must be finite and "
                                     f"at most {limit:g} in magnitude (service.limits.max_abs_reward)")


def _reward_parts(parts: list[tuple[str, float]], limit: float = MAX_ABS_REWARD) -> dict[str, float]:
    """The reward's named components: a few, named plainly (they become metric names), finite and
    within ``limit``."""
    if len(parts) > MAX_REWARD_PARTS:
        raise ValidationError("reward_parts", f"{len(parts)} parts, at most {MAX_REWARD_PARTS}")
    out: dict[str, float] = {}
    for name, value in parts:
        if not REWARD_PART_NAME.fullmatch(name):
            raise ValidationError("reward_parts", "names must be 1-48 letters, digits, '_', '-' or '.'")
        if name in out:
            raise ValidationError("reward_parts", f"{name!r} twice")
        _in_range("reward_parts", f"part {name!r}", value, limit)
        out[name] = float(value)
    return out


# Up to this K, rotations beat numpy's per-row sort (measured, P = 4096, CPU time: 4x at K = 8,
# 1.15x at K = 16, 1.07x at K = 20; slower from K = 24 on).
_ROTATE_MAX_K = 20


def _rows_have_repeats(ids: np.ndarray) -> bool:
    """Whether any row of ``ids`` [P, K] holds an id twice. Exact.

    Columns ``a < b`` are ``b - a`` apart one way round a row and ``K - (b - a)`` the other, and one
    of the two is at most ``K // 2``: comparing every row with itself rotated by ``s = 1 .. K // 2``
    compares every pair of columns. On the transposed [K, P] copy each rotation is one vectorised
    comparison of two contiguous slices, instead of ``P`` tiny sorts.

    The rotations compare the ids' low 16 bits (half the bytes to move: 0.13 instead of 0.20 ms at
    P = 4096, K = 20); only the pairs that agree there, a few per record of distinct random ids,
    are compared again in full, so the answer stays exact.
    """
    p, k = ids.shape
    if k < 2 or p == 0:
        return False
    if k > _ROTATE_MAX_K:
        s = np.sort(ids, axis=1)
        return bool((s[:, 1:] == s[:, :-1]).any())
    h = k // 2
    cols = np.empty((k + h, p), np.uint16)  # the columns, then the first h again: rotation = slice
    # Casting to uint16 keeps the low 16 bits (two's complement for negatives). Cast first, in
    # the [P, K] order (one contiguous pass), then transpose 2-byte items: ~10 % less time
    # than the transposing int32 -> uint16 cast (12 of 123 us at P = 4096, K = 20).
    cols[:k] = ids.astype(np.uint16).T
    cols[k:] = cols[:h]
    eq = np.empty((k, p), bool)
    for shift in range(1, h + 1):
        # At shift K/2 the rotation's second half repeats its first half's pairs.
        m = k if 2 * shift != k else shift
        np.equal(cols[shift:shift + m], cols[:m], out=eq[:m])
        if eq[:m].any():
            col, row = np.nonzero(eq[:m])
            if bool((ids[row, col] == ids[row, (col + shift) % k]).any()):
                return True
    return False


def _validate_support(msg: WireTrajectory, ctx: ValidationContext, p: int, sampled: np.ndarray):
    fields = ("support_indptr", "support_ids", "support_logprobs")
    present = [f in msg.arrays for f in fields]
    if not ctx.truncation:
        for f, has in zip(fields, present, strict=True):
            if has and len(msg.arrays[f].data):
                raise ValidationError(f, "must be empty: the task's sampling has no truncation")
        return None, None, None
    for f, has in zip(fields, present, strict=True):
        if not has:
            raise ValidationError(f, "missing: the task's sampling truncates (top_p < 1 or top_k > 0)")
    indptr = _arr(msg, "support_indptr", "int32", 1)
    _expect_shape("support_indptr", indptr, (p + 1,))
    ids = _arr(msg, "support_ids", "int32", 1)
    nnz = ids.shape[0]
    if int(indptr[0]) != 0 or int(indptr[-1]) != nnz:
        raise ValidationError("support_indptr", f"must start at 0 and end at len(support_ids) = {nnz}")
    lengths = np.diff(indptr)
    if bool((lengths < 1).any()):
        raise ValidationError("support_indptr", "every token needs a non-empty support (increasing offsets)")
    if ctx.max_support is not None and int(lengths.max()) > ctx.max_support:
        t = int(np.argmax(lengths > ctx.max_support))
        raise ValidationError("support_indptr", f"the kept set at policy position {t} has {int(lengths[t])} "
                                                f"ids, more than train.support_k = {ctx.max_support}")
    _ids_in_range("support_ids", ids, ctx.vocab_size)
    lps = _arr(msg, "support_logprobs", "float32", 1)
    _expect_shape("support_logprobs", lps, (nnz,))
    _finite_logprobs("support_logprobs", lps)
    # One int64 key per (token position, id): unique keys <=> ids unique within each row, and
    # the sampled token is in its row iff its key is among them.
    rows = np.repeat(np.arange(p, dtype=np.int64), lengths)
    keys = np.sort(rows * ctx.vocab_size + ids)
    if nnz > 1 and bool((keys[1:] == keys[:-1]).any()):
        raise ValidationError("support_ids", "ids within a token's support must be unique")
    want = np.arange(p, dtype=np.int64) * ctx.vocab_size + sampled
    pos = np.minimum(np.searchsorted(keys, want), nnz - 1)
    missing = keys[pos] != want
    if bool(missing.any()):
        t = int(np.argmax(missing))
        raise ValidationError("support_ids", f"the sampled token {int(sampled[t])} at policy position {t} "
                                             "is not in its support")
    return indptr, ids, lps
