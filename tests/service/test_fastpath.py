"""The zero-copy Trajectory decoder agrees with the protobuf runtime on every input."""

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from mixrl_wire import pb
from mixrl_wire.fastpath import decode_trajectory, from_message, parse_trajectory

ARRAYS = ["token_ids", "loss_mask", "logprobs", "logprobs_full", "versions", "head_ids", "head_logprobs",
          "support_indptr", "support_ids", "support_logprobs"]


def _same(a, b) -> None:
    for f in ("session_id", "lease_id", "task_id", "sample_index", "finish_reason", "queue_ms",
              "generate_ms"):
        assert getattr(a, f) == getattr(b, f), f
    assert (a.reward is None) == (b.reward is None)
    if a.reward is not None:
        assert a.reward == b.reward or (np.isnan(a.reward) and np.isnan(b.reward))
    assert set(a.arrays) == set(b.arrays)
    for k, x in a.arrays.items():
        y = b.arrays[k]
        assert (x.dtype, x.shape, bytes(x.data)) == (y.dtype, y.shape, bytes(y.data)), k


@st.composite
def trajectories(draw) -> pb.Trajectory:
    m = pb.Trajectory(session_id=draw(st.text(max_size=8)), lease_id=draw(st.text(max_size=8)),
                      task_id=draw(st.integers(0, 2**64 - 1)),
                      sample_index=draw(st.integers(-2**31, 2**31 - 1)),
                      finish_reason=draw(st.text(max_size=8)))
    for name in draw(st.lists(st.sampled_from(ARRAYS), unique=True)):
        a = getattr(m, name)
        a.dtype = draw(st.integers(-3, 7))
        a.shape.extend(draw(st.lists(st.integers(-2**40, 2**40), max_size=3)))
        a.data = draw(st.binary(max_size=64))
    if draw(st.booleans()):
        m.reward = draw(st.floats(width=32, allow_nan=True))
    if draw(st.booleans()):
        m.timings.queue_ms = draw(st.floats(allow_nan=False))
        m.timings.generate_ms = draw(st.floats(allow_nan=False))
    return m


@settings(max_examples=300, deadline=None)
@given(m=trajectories(), extra=st.binary(max_size=24), dup=st.booleans())
def test_fast_decoder_matches_protobuf(m, extra, dup):
    data = m.SerializeToString()
    if dup and m.HasField("head_ids"):
        # An embedded message sent twice is merged by protobuf: the fast path must defer.
        data += pb.Trajectory(head_ids=pb.Array(shape=[7])).SerializeToString()
        assert parse_trajectory(data) is None
    try:
        ref = pb.Trajectory.FromString(data + extra)
    except DecodeError:
        with pytest.raises(DecodeError):
            decode_trajectory(data + extra)
        return
    _same(decode_trajectory(data + extra), from_message(ref))


def test_arrays_are_views_of_the_received_bytes():
    m = pb.Trajectory(head_ids=pb.Array(dtype=pb.DTYPE_INT32, shape=[2], data=b"\x01\0\0\0\x02\0\0\0"))
    data = bytearray(m.SerializeToString())
    t = parse_trajectory(bytes(data))
    assert t is not None and t.arrays["head_ids"].data.obj is not None
    assert np.frombuffer(t.arrays["head_ids"].data, np.int32).tolist() == [1, 2]


def test_garbage_is_refused_by_the_service_as_invalid_argument():
    from trainer_jax.config import load_config
    from trainer_jax.service import RolloutService

    svc = RolloutService.from_config(load_config(None, ["service.listen=127.0.0.1:0"]), token="t")
    ack = svc._submit(b"\xff\xff\xff")
    assert ack.code == 3 and ack.reason.startswith("message:")
