"""Trajectory validation in isolation: valid records pass, each kind of corruption names its field."""

import numpy as np
import pytest
from fakes import fake_trajectory
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mixrl_wire import pb
from mixrl_wire.arrays import encode
from trainer_jax.service.validation import ValidationContext, ValidationError, validate_trajectory

V, K = 50, 4


def _task(top_p=1.0, top_k=0, max_new=8) -> pb.Task:
    return pb.Task(lease_id="L", task_id=7, sample_indices=[0], group_size=1, prompt_ids=[1, 2],
                   sampling=pb.SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k, head_k=K,
                                              max_new_tokens=max_new))


def _ctx(truncation=False, version=3, max_policy=8) -> ValidationContext:
    return ValidationContext(vocab_size=V, head_k=K, truncation=truncation, max_tokens=64,
                             max_policy_tokens=max_policy, current_version=version)


@pytest.mark.parametrize("truncated", [False, True])
def test_valid_trajectory_round_trips(truncated):
    rng = np.random.default_rng(0)
    msg = fake_trajectory(_task(top_p=0.8 if truncated else 1.0), 0, V, rng, n_tokens=6, version=2,
                          env_tokens=3)
    rec = validate_trajectory(pb.Trajectory.FromString(msg.SerializeToString()), _ctx(truncated))
    assert rec.token_ids.shape == (9,) and rec.num_policy_tokens == 6
    assert rec.head_ids.shape == (6, K) and (rec.versions == 2).all()
    assert (rec.support_indptr is not None) == truncated
    if truncated:
        for t, tok in enumerate(rec.policy_token_ids()):
            assert tok in rec.support_ids[rec.support_indptr[t]:rec.support_indptr[t + 1]]


def _mutated(field, fn, truncated=False, **kw):
    rng = np.random.default_rng(1)
    msg = fake_trajectory(_task(top_p=0.8 if truncated else 1.0), 0, V, rng, n_tokens=5, version=1, **kw)
    fn(msg)
    with pytest.raises(ValidationError) as info:
        validate_trajectory(msg, _ctx(truncated))
    assert info.value.field == field, str(info.value)
    return str(info.value)


def _set(field, values, dtype):
    def fn(msg):
        encode(values(msg), dtype, getattr(msg, field))
    return fn


def _arr(msg, field, dtype):
    from mixrl_wire.arrays import decode
    a = getattr(msg, field)
    return decode(a, field, dtype, len(a.shape)).copy()


def _edit(field, dtype, change):
    def values(msg):
        a = _arr(msg, field, dtype)
        change(a)
        return a
    return _set(field, values, dtype)


CASES = [
    ("token_ids", _edit("token_ids", "int32", lambda a: a.__setitem__(0, V))),
    ("token_ids", _edit("token_ids", "int32", lambda a: a.__setitem__(0, -1))),
    ("token_ids", lambda m: m.ClearField("token_ids")),
    ("token_ids", lambda m: encode(np.zeros(0, np.int32), "int32", m.token_ids)),
    ("token_ids", lambda m: encode(np.zeros(3, np.float32), "float32", m.token_ids)),
    ("token_ids", lambda m: m.token_ids.shape.__setitem__(0, 99)),
    ("loss_mask", _edit("loss_mask", "uint8", lambda a: a.__setitem__(0, 2))),
    ("loss_mask", lambda m: encode(np.zeros(5, np.uint8), "uint8", m.loss_mask)),
    ("loss_mask", lambda m: encode(np.ones(4, np.uint8), "uint8", m.loss_mask)),
    ("logprobs", _edit("logprobs", "float32", lambda a: a.__setitem__(1, np.nan))),
    ("logprobs", _edit("logprobs", "float32", lambda a: a.__setitem__(1, 0.5))),
    ("logprobs", _edit("logprobs", "float32", lambda a: a.__setitem__(1, -np.inf))),
    ("logprobs", lambda m: encode(np.zeros(4, np.float32) - 1, "float32", m.logprobs)),
    ("logprobs_full", _edit("logprobs_full", "float32", lambda a: a.__setitem__(0, np.inf))),
    ("versions", _edit("versions", "int32", lambda a: a.__setitem__(2, 4))),  # newer than published 3
    ("versions", _edit("versions", "int32", lambda a: a.__setitem__(2, -1))),
    ("versions", _edit("versions", "int32", lambda a: a.__setitem__(slice(0, 2), 3))),  # decreasing
    ("head_ids", _edit("head_ids", "int32", lambda a: a.__setitem__((0, 1), a[0, 0]))),
    ("head_ids", _edit("head_ids", "int32", lambda a: a.__setitem__((0, 1), V + 3))),
    ("head_ids", lambda m: encode(np.zeros((5, K - 1), np.int32), "int32", m.head_ids)),
    ("head_logprobs", _edit("head_logprobs", "float32", lambda a: a.__setitem__((0, slice(None)),
                                                                                 a[0, ::-1].copy()))),
    ("head_logprobs", _edit("head_logprobs", "float32", lambda a: a.__setitem__((3, 0), np.nan))),
    ("support_indptr", lambda m: encode(np.arange(6, dtype=np.int32), "int32", m.support_indptr)),
    ("reward", lambda m: setattr(m, "reward", float("nan"))),
    ("finish_reason", lambda m: setattr(m, "finish_reason", "x" * 100)),
    ("timings.generate_ms", lambda m: setattr(m.timings, "generate_ms", -1.0)),
]


@pytest.mark.parametrize(("field", "mutate"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_corruption_names_its_field(field, mutate):
    _mutated(field, mutate)


TRUNC_CASES = [
    ("support_indptr", lambda m: m.ClearField("support_indptr")),
    ("support_indptr", _edit("support_indptr", "int32", lambda a: a.__setitem__(-1, a[-1] - 1))),
    ("support_indptr", _edit("support_indptr", "int32", lambda a: a.__setitem__(2, a[1]))),
    ("support_ids", _edit("support_ids", "int32", lambda a: a.__setitem__(1, a[0]))),
    ("support_ids", _edit("support_ids", "int32", lambda a: a.__setitem__(0, V))),
    ("support_logprobs", _edit("support_logprobs", "float32", lambda a: a.__setitem__(0, 1.0))),
]


@pytest.mark.parametrize(("field", "mutate"), TRUNC_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(TRUNC_CASES)])
def test_support_corruptions(field, mutate):
    _mutated(field, mutate, truncated=True)


def test_sampled_token_outside_its_support_is_rejected():
    def fn(msg):
        tokens = _arr(msg, "token_ids", "int32")
        ids = _arr(msg, "support_ids", "int32")
        indptr = _arr(msg, "support_indptr", "int32")
        row0 = set(ids[indptr[0]:indptr[1]].tolist())
        tokens[0] = next(t for t in range(V) if t not in row0)
        encode(tokens, "int32", msg.token_ids)
    assert "not in its support" in _mutated("support_ids", fn, truncated=True)


def test_policy_token_limit_and_environment_tokens():
    rng = np.random.default_rng(2)
    msg = fake_trajectory(_task(), 0, V, rng, n_tokens=8, env_tokens=20)  # 28 tokens, 8 policy
    validate_trajectory(msg, _ctx(max_policy=8))
    with pytest.raises(ValidationError, match="loss_mask"):
        validate_trajectory(msg, _ctx(max_policy=7))


# Property: any byte-level or field-level damage either leaves a trajectory that still satisfies
# every invariant, or raises ValidationError -- never another exception.
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_damage_is_rejected_cleanly(data):
    truncated = data.draw(st.booleans())
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    msg = fake_trajectory(_task(top_p=0.7 if truncated else 1.0), 0, V, rng, n_tokens=4)
    fields = ["token_ids", "loss_mask", "logprobs", "logprobs_full", "versions", "head_ids",
              "head_logprobs"] + (["support_indptr", "support_ids", "support_logprobs"] if truncated else [])
    field = data.draw(st.sampled_from(fields))
    arr = getattr(msg, field)
    how = data.draw(st.sampled_from(["bytes", "shape", "dtype", "drop"]))
    if how == "bytes" and arr.data:
        raw = bytearray(arr.data)
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
        arr.data = bytes(raw)
    elif how == "shape":
        arr.shape.append(data.draw(st.integers(-2, 3)))
    elif how == "dtype":
        arr.dtype = data.draw(st.integers(0, 6))
    else:
        msg.ClearField(field)
    try:
        rec = validate_trajectory(msg, _ctx(truncated))
    except ValidationError as e:
        assert e.field.split(".")[0] in fields or e.field == "timings"
        return
    # Survived: then it must really be valid.
    assert np.isfinite(rec.logprobs).all() and (rec.logprobs <= 1e-5).all()
    assert ((rec.token_ids >= 0) & (rec.token_ids < V)).all()
    assert (rec.versions <= 3).all()


def test_reward_parts_are_kept_and_bad_ones_refused():
    """``Trajectory.reward_parts`` become metric names: kept when few, plain and finite; a
    trajectory with a part that is not is refused naming the field."""
    rng = np.random.default_rng(2)
    msg = fake_trajectory(_task(), 0, V, rng, n_tokens=5, version=1)
    msg.reward_parts.add(name="says_word", value=1.0)
    msg.reward_parts.add(name="short", value=0.5)
    assert validate_trajectory(msg, _ctx()).reward_parts == {"says_word": 1.0, "short": 0.5}

    def add(*parts):
        def fn(m):
            for name, value in parts:
                m.reward_parts.add(name=name, value=value)
        return fn

    assert "names" in _mutated("reward_parts", add(("env/../x", 1.0)))
    assert "twice" in _mutated("reward_parts", add(("a", 1.0), ("a", 2.0)))
    assert "finite" in _mutated("reward_parts", add(("a", float("nan"))))
    assert "at most 16" in _mutated("reward_parts", add(*((f"p{i}", 1.0) for i in range(17))))


def test_a_steps_reward_parts_are_logged_per_environment():
    from types import SimpleNamespace

    from trainer_jax.service.tasks import env_reward_part_metrics

    sample = lambda **parts: SimpleNamespace(reward_parts=parts)  # noqa: E731
    echo = [sample(says_word=1.0, short=0.0), sample(says_word=0.0)]
    groups = [SimpleNamespace(task=SimpleNamespace(env="echo"), trajectories=echo),
              SimpleNamespace(task=SimpleNamespace(env="guess"), trajectories=[sample()])]
    assert env_reward_part_metrics(groups) == {"env/echo/reward/says_word": 0.5, "env/echo/reward/short": 0.0}


def test_a_sampler_cleans_reward_parts_before_sending():
    from mixrl_wire.reward_parts import clean

    dirty = {"ok": 1, "bad name": 1.0, "nan": float("nan"), "text": "1", "flag": True,
             **{f"p{i}": i for i in range(20)}}
    out = clean(dirty)
    assert out["ok"] == 1.0 and out["flag"] == 1.0 and len(out) == 16
    assert not {"bad name", "nan", "text"} & out.keys()
    assert clean(["not", "a", "dict"]) == {}
