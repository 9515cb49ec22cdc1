"""The router's constraints at their limits (issue 46): stability bounds of 0 and values exactly at
a bound, ``min_share`` 0 and at ``1 / groups``, ``max_share`` that exactly fits, one group, no
priced group; and policy ``cost`` against a reference computed here on generated fleets.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from trainer_jax.config import RouterConfig
from trainer_jax.service.router import GroupStats, cost_policy, over_bounds


def _g(name: str, *, rate: float | None = 1.0, price: float | None = 1.0, samplers: int = 1,
       useful: float | None = 1.0, k3: float | None = 0.0, oor: float | None = 0.0, stale: bool = False):
    return GroupStats(name, samplers=samplers, capacity=4 * samplers, samples_per_busy_s=rate,
                      price_per_hour=price, useful_share=useful, k3=k3, out_of_range=oor, stale=stale)


def test_a_bound_of_zero_floors_only_a_group_above_zero():
    """Issue 46: ``max_out_of_range: 0`` (valid) with a ``>=`` floored every group and policy
    cost fell back to equal shares; a group measuring exactly 0 is within the bound."""
    cfg = RouterConfig(policy="cost", max_out_of_range=0.0, max_k3=0.0, min_share=0.05)
    groups = {"a": _g("a", rate=3.0), "b": _g("b", rate=1.0), "c": _g("c", rate=1.0, price=2.0)}
    for g in groups.values():
        assert over_bounds(g, cfg) is None
    shares = cost_policy(groups, cfg)
    assert shares == pytest.approx({"a": 3 / 4.5, "b": 1 / 4.5, "c": 0.5 / 4.5})
    groups["b"].out_of_range = 1e-9  # just above: floored
    assert over_bounds(groups["b"], cfg) == "out_of_range 1e-09 > max_out_of_range 0"
    assert cost_policy(groups, cfg)["b"] == pytest.approx(0.05)
    groups["b"].out_of_range, groups["c"].k3 = 0.0, 1e-9
    assert over_bounds(groups["c"], cfg).startswith("k3 1e-09 > max_k3 0")


def test_values_exactly_at_a_bound_are_within_it():
    cfg = RouterConfig(policy="cost", max_out_of_range=0.01, max_k3=0.2)
    assert over_bounds(_g("a", k3=0.2, oor=0.01), cfg) is None
    assert over_bounds(_g("a", k3=0.2000001), cfg) is not None
    assert over_bounds(_g("a", oor=0.0100001), cfg) is not None
    assert over_bounds(_g("a", stale=True), cfg) == "staleness above train.max_staleness"
    assert over_bounds(_g("a", k3=None, oor=None), cfg) is None  # unmeasured: within


def test_min_share_zero_one_group_and_nothing_priced():
    groups = {"a": _g("a", rate=9.0), "b": _g("b", rate=1.0), "c": _g("c", price=None)}
    assert cost_policy(groups, RouterConfig(policy="cost", min_share=0.0)) == pytest.approx(
        {"a": 0.9, "b": 0.1, "c": 0.0})
    # a floor above 1 / groups is 1 / groups: everyone gets a third
    assert cost_policy(groups, RouterConfig(policy="cost", min_share=0.5, max_share=0.5)) == pytest.approx(
        {"a": 1 / 3, "b": 1 / 3, "c": 1 / 3})
    assert cost_policy({"a": _g("a", price=None)}, RouterConfig(policy="cost")) == {"a": 1.0}
    assert cost_policy({"a": _g("a")}, RouterConfig(policy="cost", max_share=0.3)) == {"a": 1.0}
    nothing = {"a": _g("a", price=None), "b": _g("b", price=0.0)}  # no weight at all: equal parts
    assert cost_policy(nothing, RouterConfig(policy="cost")) == {"a": 0.5, "b": 0.5}
    assert cost_policy({}, RouterConfig(policy="cost")) == {}


def test_a_max_share_that_exactly_fits_and_one_that_binds():
    groups = {"a": _g("a", rate=8.0), "b": _g("b", rate=1.0), "c": _g("c", rate=1.0)}
    cfg = RouterConfig(policy="cost", min_share=0.0, max_share=0.8)
    assert cost_policy(groups, cfg) == pytest.approx({"a": 0.8, "b": 0.1, "c": 0.1})  # exactly at the cap
    cfg = RouterConfig(policy="cost", min_share=0.0, max_share=0.5)
    assert cost_policy(groups, cfg) == pytest.approx({"a": 0.5, "b": 0.25, "c": 0.25})


def reference_shares(groups: dict[str, GroupStats], cfg: RouterConfig) -> dict[str, float]:
    """Policy cost as the router's docstrings state it, computed directly: weight = samplers x
    rate x useful share / price (unmeasured: the live groups' mean; no price or over a bound: 0); shares in
    proportion, groups below the floor min(min_share, 1 / n) raised to it and the rest scaled
    down; then no share above max_share, the excess spread over the others in proportion."""
    live = [s for s in groups.values() if s.samplers > 0]
    rates = [s.samples_per_busy_s for s in live if s.samples_per_busy_s is not None]
    usefuls = [s.useful_share for s in live if s.useful_share is not None]
    mean_rate = sum(rates) / len(rates) if rates else 1.0
    mean_useful = sum(usefuls) / len(usefuls) if usefuls else 1.0
    w = {}
    for s in live:
        bad = ((cfg.max_k3 is not None and s.k3 is not None and s.k3 > cfg.max_k3)
               or (cfg.max_out_of_range is not None and s.out_of_range is not None
                   and s.out_of_range > cfg.max_out_of_range) or s.stale)
        if not s.price_per_hour or bad:
            w[s.name] = 0.0
        else:
            r = mean_rate if s.samples_per_busy_s is None else s.samples_per_busy_s
            u = mean_useful if s.useful_share is None else s.useful_share
            w[s.name] = s.samplers * r * u / s.price_per_hour
    if not w:
        return {}
    total = sum(w.values())
    if total <= 0:
        return {g: 1 / len(w) for g in w}
    shares = {g: x / total for g, x in w.items()}
    if cfg.min_share > 0 and len(shares) > 1:
        floor = min(cfg.min_share, 1 / len(shares))
        low = [g for g, x in shares.items() if x < floor]
        rest = sum(x for g, x in shares.items() if g not in low)
        shares = {g: floor if g in low else x * (1 - floor * len(low)) / rest for g, x in shares.items()}
    cap = cfg.max_share
    if cap < 1 and len(shares) * cap >= 1:
        for _ in range(len(shares)):
            over = [g for g, x in shares.items() if x > cap + 1e-12]
            if not over:
                break
            excess = sum(shares[g] - cap for g in over)
            under = {g: x for g, x in shares.items() if x < cap}
            room = sum(under.values())
            for g in over:
                shares[g] = cap
            for g, x in under.items():
                shares[g] = x + excess * (x / room if room > 0 else 1 / len(under))
    return shares


_opt = st.one_of(st.none(), st.sampled_from([0.0, 0.01, 0.2, 1.0]))


@st.composite
def _fleet(draw):
    groups = {}
    for i in range(draw(st.integers(1, 5))):
        name = f"g{i}"
        groups[name] = _g(name, rate=draw(st.one_of(st.none(), st.sampled_from([0.5, 1.0, 4.0]))),
                          price=draw(st.sampled_from([None, 0.0, 1.0, 2.5])),
                          samplers=draw(st.sampled_from([0, 1, 1, 3])),
                          useful=draw(st.one_of(st.none(), st.sampled_from([0.0, 0.5, 1.0]))),
                          k3=draw(_opt), oor=draw(_opt), stale=draw(st.booleans()))
    return groups


@settings(max_examples=120, deadline=None)
@given(_fleet(), st.sampled_from([0.0, 0.05, 0.2, 0.5]), st.sampled_from([1.0, 0.6, 0.5, 0.34]),
       _opt, _opt)
def test_cost_policy_is_the_reference_on_generated_fleets(groups, min_share, max_share, max_k3, max_oor):
    cfg = RouterConfig(policy="cost", min_share=min_share, max_share=max(max_share, min_share),
                       max_k3=max_k3, max_out_of_range=max_oor)
    got, want = cost_policy(groups, cfg), reference_shares(groups, cfg)
    assert got == pytest.approx(want, abs=1e-9)
    if got:
        assert sum(got.values()) == pytest.approx(1.0)
        assert set(got) == {g for g, s in groups.items() if s.samplers > 0}


def test_only_live_windows_count_towards_measuring_a_silent_group_at_zero():
    """A group whose samplers all left is not silent: windows without a live sampler do not count
    towards the five that measure it at 0 tokens/s. Counting them (``samplers >= 0``) floored a
    group that came back after a pause (mutate_human, router.py)."""
    from trainer_jax.service.router import Router

    now = [0.0]
    r = Router(RouterConfig(policy="throughput", interval_s=1.0, min_share=0.05), clock=lambda: now[0])
    r.group("a").samplers, r.group("b").samplers = 0, 1
    for _ in range(8):  # eight windows: b works, a has no live sampler
        r.record("b", 100)
        now[0] += 1.0
        r.shares()
    r.groups["a"].samplers = 1  # a's sampler is back
    assert r.groups["a"].tokens_per_s is None  # unmeasured: counted as the mean
    assert r.shares() == pytest.approx({"a": 0.5, "b": 0.5})
    for _ in range(5):  # five live windows without a token: measured at 0, then on the floor
        r.record("b", 100)
        now[0] += 1.0
        r.shares()
    assert r.groups["a"].tokens_per_s == 0.0 and r.shares()["a"] == pytest.approx(0.05)
