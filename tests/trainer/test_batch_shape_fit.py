"""Batch-shape fit (``trainer_jax.batch_shape.fit``) at exactly ``row_len`` and against a first-fit
simulation written here (issue 46): rows filled one sample at a time, the token budget spent one
sample at a time, on generated shapes and mixes, with the boundaries generated inputs rarely hit
(a sample exactly a row long, a budget exactly a multiple of the policy tokens, no samples, one
row, an entry one token too long).
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import example, given, settings

from trainer_jax.batch_shape import Demand, check, fit
from trainer_jax.config import ConfigError, load_config


def first_fit_capacity(rows: int, row_len: int, max_tokens: int, length: int, policy: int) -> int:
    """How many samples of ``length`` tokens (``policy`` trained) first-fit places before it
    refuses one: each goes into the first row with room, while the token budget lasts."""
    if length > row_len:
        return 0
    free, budget, placed = [row_len] * rows, max_tokens, 0
    while budget >= policy:
        row = next((i for i, f in enumerate(free) if f >= length), None)
        if row is None:
            break
        free[row] -= length
        budget -= policy
        placed += 1
        if placed > 10_000:  # policy 0 and length 0 cannot happen (both >= 1 below)
            break
    return placed


def reference(samples: int, demands: list[Demand], rows: int, row_len: int, max_tokens: int):
    """(too_long entries, capacity, drop share) by the module's rules, capacity by simulation."""
    total = sum(d.share for d in demands) or 1.0
    long_ = [d for d in demands if d.tokens > row_len]
    ok = [d for d in demands if d.tokens <= row_len]
    capacity = first_fit_capacity(rows, row_len, max_tokens, max(d.tokens for d in ok),
                                  max(d.policy for d in ok)) if ok else 0
    long_share = sum(d.share for d in long_) / total
    want = samples * (1 - long_share)
    dropped = long_share + (max(0.0, want - capacity) / samples if samples else 0.0)
    return tuple(d.env for d in long_), capacity, min(1.0, dropped)


def test_a_sample_exactly_a_row_long_fits():
    """Issue 46: a config whose longest sample is exactly ``row_len`` was refused (``>=`` for ``>``)."""
    one = [Demand("a", 1.0, tokens=32, policy=16)]
    f = fit(4, one, rows=4, row_len=32, max_tokens=64)
    assert f.too_long == () and f.capacity == 4 and f.fits and f.longest == 32
    over = fit(4, [Demand("a", 1.0, tokens=33, policy=16)], rows=4, row_len=32, max_tokens=64)
    assert over.too_long == ("a",) and over.drop_share == 1.0
    # the budget exactly a multiple of the policy tokens: all four placed; one token less: three
    assert fit(4, one, rows=4, row_len=32, max_tokens=63).capacity == 3


def test_a_config_whose_longest_sample_is_exactly_row_len_passes():
    # arithmetic's longest prompt given as 5 tokens, 11 new: 16, the row's length
    base = ["tasks.env=arithmetic", "tasks.group_size=2", "tasks.sampling.max_new_tokens=11",
            "train.prompts_per_step=4", "train.rows=8", "train.row_len=16", "train.max_tokens=88"]
    assert check(load_config(None, base), [5]) is None
    with pytest.raises(ConfigError, match="longer than train.row_len 16"):
        check(load_config(None, base), [6])
    with pytest.raises(ConfigError, match="place at least 7"):  # one row fewer than the samples
        check(load_config(None, [*base, "train.rows=7"]), [5])
    assert check(load_config(None, base)) is None  # prompts not known yet: counted as 0
    with pytest.raises(ConfigError) as e:  # the token budget binds: 80 // 11 = 7 of 8
        check(load_config(None, [*base, "train.max_tokens=80"]), [5])
    for part in ("= 8 samples of up to 16 tokens", "place at least 8 of them (1 a row)",
                 "train.max_tokens 80 at least 7 (11 policy tokens each)", "up to 12% of a step's",
                 "Fits: train.rows 8 or more", "and train.max_tokens 88,"):
        assert part in str(e.value), (part, str(e.value))


_demand = st.builds(lambda env, share, tokens, policy: Demand(env, share, tokens, min(policy, tokens)),
                    st.sampled_from(["a", "b", "c"]), st.sampled_from([0.5, 1.0, 3.0]),
                    st.integers(1, 40), st.integers(1, 40))


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 24), st.lists(_demand, min_size=1, max_size=3), st.integers(1, 4),
       st.integers(1, 40), st.integers(0, 200))
@example(4, [Demand("a", 1.0, 32, 16)], 4, 32, 64)
@example(6, [Demand("a", 1.0, 20, 20), Demand("b", 1.0, 21, 5)], 3, 20, 60)
@example(0, [Demand("a", 1.0, 10, 10)], 1, 10, 10)
def test_fit_is_the_first_fit_simulation_on_generated_shapes(samples, demands, rows, row_len, max_tokens):
    f = fit(samples, demands, rows=rows, row_len=row_len, max_tokens=max_tokens)
    too_long, capacity, drop = reference(samples, demands, rows, row_len, max_tokens)
    assert f.too_long == too_long
    assert f.capacity == capacity
    ok = [d for d in demands if d.tokens <= row_len]
    if ok:  # each bound alone: the other made unlimited
        length, policy = max(d.tokens for d in ok), max(d.policy for d in ok)
        assert (f.longest, f.policy) == (length, policy)
        assert f.rows_capacity == first_fit_capacity(rows, row_len, 10**6, length, policy)
        assert f.tokens_capacity == first_fit_capacity(10**4, row_len, max_tokens, length, policy)
    assert f.drop_share == pytest.approx(drop)
    assert f.fits == (drop == 0.0)
