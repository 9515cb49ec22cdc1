"""Router behaviour the router's mutants showed untested (issue 37; docs/testing.md)."""

from __future__ import annotations

import pytest

from trainer_jax.config import RouterConfig
from trainer_jax.service.router import POLICIES, GroupStats, Router, _capped


def test_uniform_shares_go_to_every_group_with_a_live_sampler():
    groups = {"one": GroupStats("one", samplers=1), "three": GroupStats("three", samplers=3),
              "none": GroupStats("none")}
    shares = POLICIES["uniform"](groups, RouterConfig())
    assert shares == pytest.approx({"one": 0.5, "three": 0.5}) and shares.get("none", 0.0) == 0.0


def test_a_cap_that_exactly_fits_is_applied():
    # 2 groups at max_share 0.5: the cap can be met exactly, so it is (only a cap the groups cannot
    # fill, n x max_share < 1, is left unapplied)
    assert _capped({"a": 0.8, "b": 0.2}, 0.5) == pytest.approx({"a": 0.5, "b": 0.5})
    assert _capped({"a": 0.6, "b": 0.3, "c": 0.1}, 0.5) == pytest.approx({"a": 0.5, "b": 0.375, "c": 0.125})
    assert _capped({"a": 0.8, "b": 0.2}, 0.4) == {"a": 0.8, "b": 0.2}
    # the others have no weight at all: the excess is split between them equally
    assert _capped({"a": 1.0, "b": 0.0, "c": 0.0}, 0.4) == pytest.approx({"a": 0.4, "b": 0.3, "c": 0.3})


def test_samples_per_busy_replica_second_is_smoothed_across_windows():
    now = [0.0]
    router = Router(RouterConfig(policy="cost", interval_s=1.0, ema_alpha=0.5, min_share=0.0),
                    clock=lambda: now[0])
    a = router.group("a")
    a.samplers, a.capacity, a.outstanding = 1, 10, 10  # one replica, fully busy
    rates = []
    for end, samples in ((2.0, 2), (4.0, 1), (6.0, 4)):  # 1.0, then 0.5, then 2.0 per busy s
        now[0] = end - 2.0  # recorded as the window opens: a record past interval_s closes it
        for _ in range(samples):
            router.record("a", 3)
        now[0] = end
        router.shares()
        rates.append(a.samples_per_busy_s)
    assert rates == pytest.approx([1.0, 0.75, 1.375])
