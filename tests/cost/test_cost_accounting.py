"""The cost ledger's arithmetic against a hand-computed example, and policy cost's weights and
constraints (trainer_jax.cost, trainer_jax.service.router)."""

from __future__ import annotations

import pytest

from trainer_jax.config import RouterConfig
from trainer_jax.cost import CostLedger, StepCounts, status_text, useful_share
from trainer_jax.service.router import POLICIES, GroupStats, Router, cost_policy


def test_ledger_hand_computed():
    ledger = CostLedger({"a": 3.6, "b": None}, {"a": "H100"})
    # a: 2 replicas x 100 s = 200 replica-s at 3.6 USD/h = 0.20 USD; 10 samples, 50 tokens trained,
    # dropped 0 and 20 % of the kept tokens out of range: useful share 0.8 -> 8 samples, 40 tokens.
    assert useful_share(0.0, 0.2) == pytest.approx(0.8)
    assert useful_share(0.5, 0.5) == pytest.approx(0.25)  # half dropped, half the rest out of range
    assert useful_share(None, 0.1) is None
    v = ledger.step(100.0, {"a": StepCounts(replicas=2, produced_total=12, busy_replica_s_total=50.0,
                                            samples_trained=10, tokens_trained=50, useful_share=0.8),
                            "b": StepCounts(replicas=1, produced_total=4, samples_trained=4,
                                            tokens_trained=20, useful_share=0.25)})
    assert v["cost/usd_per_step"] == pytest.approx(0.2)
    assert v["cost/usd_total"] == pytest.approx(0.2)
    assert v["group/a/replica_hours"] == pytest.approx(200 / 3600)
    assert v["group/a/usd_per_useful_sample"] == pytest.approx(0.2 / 8)
    assert v["group/a/usd_per_useful_token"] == pytest.approx(0.2 / 40)
    assert v["group/a/useful_share"] == pytest.approx(0.8)
    assert v["cost/usd_per_useful_sample"] == pytest.approx(0.2 / 8)  # priced groups only
    assert v["cost/usd_busy_per_useful_sample"] == pytest.approx(3.6 * 50 / 3600 / 8)
    # b has no price: its counts, never a USD figure (not zero)
    assert v["group/b/replica_hours"] == pytest.approx(100 / 3600)
    assert v["group/b/useful_share"] == pytest.approx(0.25)
    assert not [k for k in v if k.startswith("group/b/usd")]
    # step 2: 50 s of one replica of a (0.05 USD), nothing trained
    v = ledger.step(50.0, {"a": StepCounts(replicas=1, produced_total=20), "b": StepCounts(replicas=1)})
    assert v["cost/usd_per_step"] == pytest.approx(0.05)
    assert v["cost/usd_total"] == pytest.approx(0.25)
    assert v["group/a/usd_per_useful_sample"] == pytest.approx(0.25 / 8)
    assert "group/a/useful_share" not in v  # no samples trained: no share this step
    s = ledger.summary()
    assert s["steps"] == 2 and s["usd_total"] == pytest.approx(0.25)
    a = s["groups"]["a"]
    assert (a["samples_produced"], a["samples_trained"], a["tokens_trained"]) == (20, 10, 50)
    assert a["useful_samples"] == pytest.approx(8) and a["usd"] == pytest.approx(0.25)
    assert a["accelerator"] == "H100" and "usd" not in s["groups"]["b"]
    assert s["useful_share"] == pytest.approx((40 + 5) / 70)
    assert status_text(v) == " $0.25 ($0.031/useful)"
    assert CostLedger({"b": None}).step(10.0, {"b": StepCounts(replicas=1)}).get("cost/usd_total") is None


def _groups(**over) -> dict[str, GroupStats]:
    groups = {
        "a": GroupStats("a", samplers=2, samples_per_busy_s=10.0, useful_share=0.9, price_per_hour=4.0),
        "b": GroupStats("b", samplers=1, samples_per_busy_s=10.0, useful_share=0.8, price_per_hour=1.0),
        "c": GroupStats("c", samplers=1, samples_per_busy_s=5.0, useful_share=1.0, price_per_hour=5.0),
    }
    for key, fields in over.items():
        for f, value in fields.items():
            setattr(groups[key], f, value)
    return groups


def test_cost_policy_weights_useful_samples_per_dollar():
    assert "cost" in POLICIES
    # weights: a 2 x 10 x 0.9 / 4 = 4.5, b 1 x 10 x 0.8 / 1 = 8, c 1 x 5 x 1 / 5 = 1 (of 13.5)
    shares = cost_policy(_groups(), RouterConfig(min_share=0.05))
    assert shares == pytest.approx({"a": 4.5 / 13.5, "b": 8 / 13.5, "c": 1 / 13.5})
    # max_share 0.5: b capped, its excess split between a and c in their ratio 4.5 : 1
    shares = cost_policy(_groups(), RouterConfig(min_share=0.05, max_share=0.5))
    assert shares == pytest.approx({"a": 0.5 * 4.5 / 5.5, "b": 0.5, "c": 0.5 / 5.5})
    # the floor: c's weight 1 of 13.5 is below min_share 0.1
    shares = cost_policy(_groups(), RouterConfig(min_share=0.1))
    assert shares["c"] == pytest.approx(0.1) and shares["a"] / shares["b"] == pytest.approx(4.5 / 8)


@pytest.mark.parametrize("over, cfg", [
    ({"c": {"k3": 0.2}}, RouterConfig(min_share=0.05, max_k3=0.1)),
    ({"c": {"out_of_range": 0.3}}, RouterConfig(min_share=0.05, max_out_of_range=0.25)),
    ({"c": {"stale": True}}, RouterConfig(min_share=0.05)),
    ({"c": {"price_per_hour": None}}, RouterConfig(min_share=0.05)),
])
def test_cost_policy_floors_a_group_over_a_bound(over, cfg):
    shares = cost_policy(_groups(**over), cfg)
    assert shares["c"] == pytest.approx(0.05)
    assert shares["a"] == pytest.approx(0.95 * 4.5 / 12.5) and shares["b"] == pytest.approx(0.95 * 8 / 12.5)
    assert cost_policy(_groups(c={"k3": 0.05}), cfg)["c"] == pytest.approx(1 / 13.5)  # within bounds


def test_cost_policy_unmeasured_group_counts_as_the_mean():
    groups = _groups(c={"samples_per_busy_s": None, "useful_share": None})
    # c: rate = mean(10, 10) = 10, useful = mean(0.9, 0.8) = 0.85 -> 1 x 10 x 0.85 / 5 = 1.7
    assert cost_policy(groups, RouterConfig(min_share=0.0)) == pytest.approx(
        {"a": 4.5 / 14.2, "b": 8 / 14.2, "c": 1.7 / 14.2})


def test_router_measures_samples_per_busy_replica_second_and_takes_feedback():
    now = [0.0]
    router = Router(RouterConfig(policy="cost", interval_s=1.0, ema_alpha=0.5, min_share=0.0),
                    clock=lambda: now[0])
    router.configure({"a": 2.0, "b": 1.0}, max_staleness=2)
    a, b = router.group("a"), router.group("b")
    assert (a.price_per_hour, b.price_per_hour) == (2.0, 1.0)
    a.samplers, a.capacity, a.outstanding = 1, 10, 5   # half busy
    b.samplers, b.capacity, b.outstanding = 2, 10, 20  # both replicas full
    now[0] = 0.5
    router.record("a", 3)  # one sample each inside the first 1 s window
    router.record("b", 3)
    router.record("a", 3, evaluation=True)  # an evaluation sample: tokens/s, not the busy rate
    now[0] = 2.0
    router.shares()  # the window closes: over 2 s, a was 1 busy replica-s, b 4
    assert a.busy_replica_s == pytest.approx(1.0) and b.busy_replica_s == pytest.approx(4.0)
    assert a.samples_per_busy_s == pytest.approx(1.0) and b.samples_per_busy_s == pytest.approx(0.25)
    assert (a.accepted, a.eval_accepted, a.tokens_per_s) == (2, 1, pytest.approx(3.0))
    router.observe("a", useful_share=0.5, k3=0.01, staleness=1.0)
    router.observe("a", useful_share=1.0)   # smoothed with ema_alpha 0.5
    router.observe("b", useful_share=0.8, staleness=3.0)
    assert a.useful_share == pytest.approx(0.75) and b.stale and not a.stale
    snap = router.snapshot()
    assert snap["b"]["over_bounds"] == "staleness above train.max_staleness"
    assert snap["a"]["share"] == pytest.approx(1.0)  # b over a bound, min_share 0: all to a
    router.observe("b", staleness=1.0)
    # a: 1 x 1.0 x 0.75 / 2 = 0.375; b: 2 x 0.25 x 0.8 / 1 = 0.4
    assert router.shares() == pytest.approx({"a": 0.375 / 0.775, "b": 0.4 / 0.775})
