"""Reward parts at +-inf, NaN and at their limits (issue 46): the sampler's cleaner
(``mixrl_wire.reward_parts.clean``) drops what is not a finite number, but a sampler that bypasses
it (an old one, another implementation) sends what it likes, and the trainer's validation is then
the only check. Both against a reference written here from the documented rules: at most
``MAX_PARTS``, names of 1-48 letters, digits, ``_ - .``, each once, values finite and within
``service.limits.max_abs_reward``.
"""

from __future__ import annotations

import math
import re

import hypothesis.strategies as st
import numpy as np
import pytest
from fakes import fake_trajectory
from hypothesis import example, given, settings

from mixrl_wire import pb
from mixrl_wire.reward_parts import MAX_PARTS, clean
from trainer_jax.service.validation import (
    MAX_ABS_REWARD,
    ValidationContext,
    ValidationError,
    validate_trajectory,
)

V, K = 32, 2


_BASE: list[bytes] = []


def _msg(parts: list[tuple[str, float]]) -> pb.Trajectory:
    if not _BASE:
        task = pb.Task(lease_id="L", task_id=7, sample_indices=[0], group_size=1, prompt_ids=[1, 2],
                       sampling=pb.SamplingParams(temperature=1.0, top_p=1.0, top_k=0, head_k=K,
                                                  max_new_tokens=8))
        _BASE.append(fake_trajectory(task, 0, V, np.random.default_rng(3), n_tokens=4,
                                     version=1).SerializeToString())
    msg = pb.Trajectory.FromString(_BASE[0])
    for name, value in parts:
        msg.reward_parts.add(name=name, value=value)
    return pb.Trajectory.FromString(msg.SerializeToString())  # as it arrives: through the wire format


def _validate(parts):
    ctx = ValidationContext(vocab_size=V, head_k=K, truncation=False, max_tokens=64,
                            max_policy_tokens=8, current_version=3)
    return validate_trajectory(_msg(parts), ctx).reward_parts


def reference(parts: list[tuple[str, float]]) -> dict[str, float] | None:
    """The kept parts, or None when the trajectory must be refused."""
    if len(parts) > MAX_PARTS:
        return None
    out = {}
    for name, value in parts:
        value = float(np.float32(value))  # what the wire carries
        if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,48}", name) or name in out:
            return None
        if math.isnan(value) or math.isinf(value) or abs(value) > MAX_ABS_REWARD:
            return None
        out[name] = value
    return out


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_a_part_at_inf_or_nan_from_a_sampler_that_skips_the_cleaner_is_refused(value):
    """Issue 46: only NaN was tested; a check for NaN alone let +-inf through into the metrics."""
    with pytest.raises(ValidationError) as e:
        _validate([("says_word", 1.0), ("short", value)])
    assert e.value.field == "reward_parts" and "finite" in str(e.value), str(e.value)
    assert clean({"says_word": 1.0, "short": value}) == {"says_word": 1.0}  # the cleaner drops it


def test_parts_at_their_limits():
    """``RewardPart.value`` is a float32 on the wire: one float32 step past the limit is refused."""
    assert _validate([("a", MAX_ABS_REWARD), ("b", -MAX_ABS_REWARD)]) == {"a": MAX_ABS_REWARD,
                                                                        "b": -MAX_ABS_REWARD}
    past = float(np.nextafter(np.float32(MAX_ABS_REWARD), np.float32(np.inf)))
    with pytest.raises(ValidationError, match="out_of_range"):
        _validate([("a", past)])
    assert len(_validate([(f"p{i}", 1.0) for i in range(MAX_PARTS)])) == MAX_PARTS
    with pytest.raises(ValidationError):
        _validate([(f"p{i}", 1.0) for i in range(MAX_PARTS + 1)])
    assert _validate([("x" * 48, 0.0)]) == {"x" * 48: 0.0}
    with pytest.raises(ValidationError):
        _validate([("x" * 49, 0.0)])
    assert _validate([]) == {}
    assert clean({f"p{i}": 1 for i in range(MAX_PARTS + 3)}) == {f"p{i}": 1.0 for i in range(MAX_PARTS)}


_value = st.one_of(st.sampled_from([0.0, 1.0, -1.0, math.inf, -math.inf, math.nan, MAX_ABS_REWARD,
                                    -MAX_ABS_REWARD, 2 * MAX_ABS_REWARD]), st.floats(-10, 10))
_name = st.one_of(st.sampled_from(["a", "b", "says_word", "x" * 48, "x" * 49, "", "a/b", "é"]),
                  st.text("abAB09_.-", min_size=1, max_size=8))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(_name, _value), max_size=MAX_PARTS + 2))
@example([("a", math.inf)])
@example([("a", -math.inf), ("b", 1.0)])
def test_validation_is_the_reference_on_generated_parts(parts):
    want = reference(parts)
    if want is None:
        with pytest.raises(ValidationError) as e:
            _validate(parts)
        assert e.value.field == "reward_parts"
    else:
        assert _validate(parts) == pytest.approx(want)
