"""``encode_trajectory`` writes exactly the bytes the protobuf runtime serializes for the same message."""

import numpy as np
import pytest
from fakes import fake_records

from mixrl_wire import TRAJECTORY_ARRAY_FIELDS, pb
from mixrl_wire.arrays import encode
from mixrl_wire.encoder import EncodedTrajectory, build_trajectory, encode_trajectory, support_csr
from mixrl_wire.encoder import encode_fields as encode_wire
from mixrl_wire.fastpath import decode_trajectory, from_message

VOCAB = 97


def runtime_message(task: pb.Task, sample_index: int, *, token_ids, logprobs, logprobs_full, versions,
                    head_ids, head_logprobs, loss_mask=None, support_ids=None, support_logprobs=None,
                    reward=None, finish_reason="", queue_ms=0.0, generate_ms=0.0,
                    reward_parts=None) -> pb.Trajectory:
    """The reference: the same trajectory built field by field with the protobuf runtime."""
    mask = np.ones(len(np.asarray(token_ids)), np.uint8) if loss_mask is None else loss_mask
    msg = pb.Trajectory(lease_id=task.lease_id, task_id=task.task_id, sample_index=sample_index,
                        finish_reason=finish_reason,
                        timings=pb.Timings(queue_ms=queue_ms, generate_ms=generate_ms))
    for name, values, dtype in [("token_ids", token_ids, "int32"), ("loss_mask", mask, "uint8"),
                                ("logprobs", logprobs, "float32"),
                                ("logprobs_full", logprobs_full, "float32"),
                                ("versions", versions, "int32"), ("head_ids", head_ids, "int32"),
                                ("head_logprobs", head_logprobs, "float32")]:
        encode(values, dtype, getattr(msg, name))
    if support_ids is not None:
        indptr, ids, lps = support_csr(support_ids, support_logprobs, int(np.asarray(mask).sum()))
        encode(indptr, "int32", msg.support_indptr)
        encode(ids, "int32", msg.support_ids)
        encode(lps, "float32", msg.support_logprobs)
    if reward is not None:
        msg.reward = reward
    for name, value in (reward_parts or {}).items():
        msg.reward_parts.add(name=name, value=value)
    return msg


def _records(n: int, k: int, seed: int, **kw) -> dict:
    return fake_records(n, VOCAB, k, np.random.default_rng(seed), **kw)


def _task(task_id: int = 7) -> pb.Task:
    return pb.Task(lease_id="lease-abc", task_id=task_id, sample_indices=[0, 1])


def _check(task: pb.Task, sample_index: int, session_id: str = "sess-0123", **kw) -> EncodedTrajectory:
    want = runtime_message(task, sample_index, **kw)
    assert build_trajectory(task, sample_index, **kw) == want  # the message form: no session yet
    want.session_id = session_id
    got = encode_trajectory(task, sample_index, session_id=session_id, **kw)
    assert isinstance(got.data, bytes)
    assert pb.Trajectory.FromString(got.data) == want
    assert got.to_message() == want
    assert got.data == want.SerializeToString()  # byte for byte, not only an equal message
    assert (got.task_id, got.sample_index, len(got)) == (task.task_id, sample_index, len(got.data))
    # The service's decoder sees the same fields as from the runtime's message.
    fast, slow = decode_trajectory(got.data), from_message(want)
    assert fast.arrays.keys() == slow.arrays.keys()
    for name, a in fast.arrays.items():
        b = slow.arrays[name]
        assert (a.dtype, a.shape, bytes(a.data)) == (b.dtype, b.shape, bytes(b.data)), name
    return got


@pytest.mark.parametrize(("n", "k"), [(1, 1), (3, 2), (17, 5), (256, 20)])
@pytest.mark.parametrize("reward", [None, 0.0, 1.0, -2.5])
def test_dense_shapes_and_rewards(n, k, reward):
    _check(_task(), 1, reward=reward, finish_reason="length", queue_ms=1.5, generate_ms=20.25,
           **_records(n, k, n * k))


def test_reward_parts_are_the_runtimes_bytes_and_both_decoders_read_them():
    parts = {"says_word": 1.0, "short": 0.0, "format.v2": -0.25}  # +0.0 is not written, as the runtime
    got = _check(_task(), 1, reward=1.5, finish_reason="answered", reward_parts=parts, **_records(5, 2, 1))
    assert decode_trajectory(got.data).reward_parts == list(parts.items())
    assert from_message(got.to_message()).reward_parts == list(parts.items())


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize(("top_p", "top_k"), [(0.9, 0), (1.0, 3), (0.5, 1)])
def test_support_csr(top_p, top_k, padded):
    rec = _records(12, 4, 3, top_p=top_p, top_k=top_k)
    if padded:  # rows padded with -1 ids / -inf logprobs, as a batched sampler returns them
        width = max(len(r) for r in rec["support_ids"])
        ids = np.full((12, width), -1, np.int32)
        lps = np.full((12, width), -np.inf, np.float32)
        for t, (i, lp) in enumerate(zip(rec["support_ids"], rec["support_logprobs"], strict=True)):
            ids[t, :len(i)], lps[t, :len(lp)] = i, lp
        rec["support_ids"], rec["support_logprobs"] = ids, lps
    got = _check(_task(), 0, reward=1.0, finish_reason="stop", **rec)
    assert got.to_message().HasField("support_indptr")


def test_support_csr_layout():
    """Padded and ragged rows give the same CSR: padding (-1 ids) dropped, rows kept in order."""
    ids = np.array([[3, 1, -1], [-1, -1, -1], [2, 0, 5]], np.int32)
    lps = np.array([[-0.1, -2.0, -np.inf], [-np.inf] * 3, [-0.5, -1.0, -3.0]], np.float32)
    ragged = ([r[r >= 0] for r in ids], [lp[r >= 0] for r, lp in zip(ids, lps, strict=True)])
    for args in [(ids, lps), ragged]:
        indptr, flat_ids, flat_lps = support_csr(*args, 3)
        assert indptr.tolist() == [0, 2, 2, 5] and flat_ids.tolist() == [3, 1, 2, 0, 5]
        assert flat_lps.tolist() == pytest.approx([-0.1, -2.0, -0.5, -1.0, -3.0])
    with pytest.raises(ValueError, match="rows"):
        support_csr([[1]], [[-0.1]], 2)


def test_array_fields_follow_the_proto():
    fields = pb.Trajectory.DESCRIPTOR.fields_by_name
    assert list(TRAJECTORY_ARRAY_FIELDS) == [n for n in sorted(fields, key=lambda n: fields[n].number)
                                             if fields[n].message_type is pb.Array.DESCRIPTOR]
    assert TRAJECTORY_ARRAY_FIELDS["token_ids"] == 5 and TRAJECTORY_ARRAY_FIELDS["support_logprobs"] == 14


def test_environment_tokens_and_dtype_conversion():
    rec = _records(6, 3, 1)
    env = np.arange(4, dtype=np.int64)  # int64 / bool / float64 inputs are cast, as the runtime's encode does
    tokens = np.concatenate([rec.pop("token_ids").astype(np.int64), env])
    mask = np.array([True] * 6 + [False] * 4)
    rec["logprobs"] = rec["logprobs"].astype(np.float64)
    _check(_task(), 1, token_ids=tokens, loss_mask=mask, **rec)
    # Python lists and non-contiguous views work too.
    rec = _records(5, 4, 2)
    rec["head_ids"] = np.asfortranarray(rec["head_ids"])
    rec["token_ids"] = rec["token_ids"].tolist()
    _check(_task(), 0, **rec)


def test_empty_arrays_and_defaults():
    empty = dict(token_ids=np.zeros(0, np.int32), logprobs=[], logprobs_full=[], versions=[],
                 head_ids=np.zeros((0, 4), np.int32), head_logprobs=np.zeros((0, 4), np.float32))
    _check(pb.Task(), 0, session_id="", **empty)  # every scalar at its default
    _check(pb.Task(), 0, support_ids=[], support_logprobs=[], **empty)
    _check(_task(), 0, reward=0.0, queue_ms=-0.0, **empty)  # -0.0 is not the default: written


def test_extreme_scalars():
    rec = _records(2, 2, 5)
    _check(_task(2**64 - 1), 2**31 - 1, reward=1e39, **rec)  # float32 overflow -> inf, like the runtime
    _check(_task(0), -(2**31), reward=float("-inf"), session_id="é" * 40, finish_reason="ünïcode", **rec)
    with pytest.raises(ValueError):
        encode_trajectory(_task(), 2**31, **rec)


def test_for_session_rewrites_only_the_session():
    rec = _records(9, 3, 4)
    for old, new in [("", "s" * 32), ("a" * 32, "b" * 200), ("x" * 200, ""), ("same", "same")]:
        got = encode_trajectory(_task(), 1, session_id=old, **rec)
        want = runtime_message(_task(), 1, **rec)
        want.session_id = new
        assert got.for_session(new) == want.SerializeToString()


def test_wire_encoder_rejects_what_has_no_encoding():
    with pytest.raises(ValueError, match="dtype"):
        encode_wire(arrays={"token_ids": np.zeros(3, np.int16)})
    with pytest.raises(ValueError, match="contiguous"):
        encode_wire(arrays={"head_ids": np.zeros((3, 4), np.int32).T})
    with pytest.raises(ValueError, match="not Trajectory array fields"):
        encode_wire(arrays={"tokens": np.zeros(3, np.int32)})
    assert encode_wire(arrays={}, timings=None) == pb.Trajectory().SerializeToString()


def test_encoded_trajectories_accepted_by_the_service(token):
    from fakes import fake_trajectory

    from sampler_torch.client import Backoff, RolloutClient
    from trainer_jax.config import load_config
    from trainer_jax.service import RolloutService

    cfg = load_config(None, ["service.listen=127.0.0.1:0", "tasks.group_size=2", "tasks.count=3",
                             "tasks.sampling.max_new_tokens=8", "tasks.sampling.head_k=4"])
    svc = RolloutService.from_config(cfg, token=token).start()
    c = RolloutClient(svc.address, token, group="g", capacity=8, backoff=Backoff(0.01, 0.1), max_retry_s=3.0)
    try:
        rng = np.random.default_rng(0)

        def encoded(task, i, session_id):
            s = task.sampling
            rec = fake_records(8, svc.vocab_size, s.head_k, rng, top_p=s.top_p, top_k=s.top_k)
            return encode_trajectory(task, i, finish_reason="length", session_id=session_id, **rec)

        c.register()
        tasks = c.lease(4).tasks
        items = [(t, i) for t in tasks for i in t.sample_indices]
        first = [encoded(t, i, c.session_id) for t, i in items[:2]]
        assert all(r.accepted and not r.duplicate for r in c.submit_many(first))
        assert c.submit(first[0]).duplicate
        # Encoded without (or with a stale) session: the client writes in its own.
        rest = [encoded(t, i, s) for (t, i), s in zip(items[2:], ["", "stale" * 8], strict=True)]
        assert [c.submit(e).accepted for e in rest] == [True, True]
        # A message and encoded bytes mix on one stream.
        mixed = c.submit_many([fake_trajectory(tasks[0], tasks[0].sample_indices[0], svc.vocab_size, rng),
                               first[1]])
        assert all(r.accepted and r.duplicate for r in mixed)
        assert svc.status()["totals"]["accepted"] == 4
    finally:
        c.close()
        svc.stop(grace=0)
