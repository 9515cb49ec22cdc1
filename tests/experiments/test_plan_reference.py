"""The planner (``experiments.plan_solve.solve``, ``experiments.plan.make_plan``) against brute
force on small adversarial sets (issue 46): a bound that must stay an upper bound, ``--min`` /
``--max`` per group, limits of 0 (valid: "none at all"), budgets of 0 and exact multiples of a
price, ties, zero-value groups and groups capped at 0.
"""

from __future__ import annotations

import itertools
import math

import hypothesis.strategies as st
import pytest
from hypothesis import example, given, settings

from experiments.plan import GroupMeasure, make_plan
from experiments.plan_solve import LIMIT_KEYS, Item, Limits, PlanError, check_limits, solve

NO_LIMITS = Limits({k: None for k in LIMIT_KEYS}, "test", "test")


def brute_force(items: list[tuple[str, float, float, int, int | None]], budget: float) -> tuple[float, float]:
    """(value, cost) of the best plan: every count vector in [lo, hi] within the budget, the
    highest value, then the lowest cost. items: (name, value, cost, lo, hi or None)."""
    ranges = []
    for _, _, cost, lo, hi in items:
        top = int(budget // cost) + 1 if hi is None else hi
        ranges.append(range(lo, max(lo, top) + 1))
    best = None
    for ns in itertools.product(*ranges):
        cost = sum(n * it[2] for n, it in zip(ns, items, strict=True))
        if cost > budget + 1e-9:
            continue
        value = sum(n * it[1] for n, it in zip(ns, items, strict=True))
        if best is None or value > best[0] + 1e-9 or (abs(value - best[0]) <= 1e-9 and cost < best[1] - 1e-9):
            best = (value, cost)
    return best


def test_the_bound_is_an_upper_bound_8_6_6_5_4_at_7_6_5_usd_budget_10():
    """Issue 46: by value per dollar a (8 for 7) comes first; one a leaves 3 USD, nothing else
    fits: 8.0. Two c (5.4 for 5) give 10.8. A bound that is not an upper bound prunes c's branch."""
    items = [Item("a", 8.0, 7.0), Item("b", 6.6, 6.0), Item("c", 5.4, 5.0)]
    counts, value, cost = solve(items, 10.0)
    assert counts == {"a": 0, "b": 0, "c": 2}
    assert value == pytest.approx(10.8) and cost == pytest.approx(10.0)
    want = brute_force([(i.name, i.value, i.cost, 0, None) for i in items], 10.0)
    assert want == pytest.approx((10.8, 10.0))


def test_a_budget_of_zero_or_exactly_a_price_and_groups_capped_at_zero():
    assert solve([Item("a", 5.0, 2.0)], 0.0) == ({"a": 0}, 0.0, 0.0)
    assert solve([Item("a", 5.0, 2.0)], 2.0) == ({"a": 1}, 5.0, 2.0)  # exactly one price: bought
    assert solve([Item("a", 5.0, 2.0, max_count=0), Item("b", 1.0, 2.0)], 4.0)[0] == {"a": 0, "b": 2}
    assert solve([Item("a", 0.0, 1.0), Item("b", 3.0, 3.0)], 3.0)[0] == {"a": 0, "b": 1}
    # a tie in value: the cheaper plan
    assert solve([Item("a", 6.0, 3.0), Item("b", 6.0, 2.0)], 3.0)[0] == {"a": 0, "b": 1}
    assert solve([], 5.0) == ({}, 0.0, 0.0)


_cost = st.sampled_from([1.0, 1.5, 2.0, 2.5, 3.0, 5.0, 6.0, 7.0])
_value = st.one_of(st.sampled_from([0.0, 1.0, 5.4, 6.6, 8.0]), st.floats(0.5, 20))


@settings(max_examples=120, deadline=None)
@given(st.lists(st.tuples(_value, _cost, st.sampled_from([None, None, 0, 1, 2, 3])), min_size=1, max_size=4),
       st.one_of(st.sampled_from([0.0, 5.0, 10.0, 12.0]), st.floats(0, 16)))
@example([(8.0, 7.0, None), (6.6, 6.0, None), (5.4, 5.0, None)], 10.0)
def test_solve_is_brute_force_on_generated_sets(spec, budget):
    items = [Item(f"g{i}", v, c, m) for i, (v, c, m) in enumerate(spec)]
    counts, value, cost = solve(items, budget)
    want = brute_force([(it.name, it.value, it.cost, 0, it.max_count) for it in items], budget)
    assert value == pytest.approx(want[0], abs=1e-7) and cost == pytest.approx(want[1], abs=1e-7)
    assert sum(counts[it.name] * it.value for it in items) == pytest.approx(value)
    assert sum(counts[it.name] * it.cost for it in items) <= budget + 1e-9
    assert all(it.max_count is None or counts[it.name] <= it.max_count for it in items)


def _group(name: str, rate: float, price: float, **measured) -> GroupMeasure:
    m = {"k3": 0.01, "k3_growth": 1.0, "out_of_range": 0.0, "staleness": 1.0, "probe_kl": 0.0, **measured}
    return GroupMeasure(name, tokens_per_s=100.0, tokens_per_sample=10.0, useful_share=1.0,
                        useful_from="test", rate=rate, price=price, **m)


def test_min_and_max_of_one_group_bound_its_count():
    """Issue 46: ``--min a=1 --max a=2`` planned 3 of ``a`` (the maximum not lowered by the
    replicas the minimum already bought)."""
    groups = {"a": _group("a", 10.0, 1.0), "b": _group("b", 1.0, 1.0)}
    plan = make_plan(groups, 5.0, NO_LIMITS, {"a": 1}, {"a": 2})
    assert plan.counts == {"a": 2, "b": 3}
    assert plan.useful_per_hour == pytest.approx(23.0) and plan.cost_per_hour == pytest.approx(5.0)
    assert make_plan(groups, 5.0, NO_LIMITS, {"a": 2}, {"a": 2}).counts == {"a": 2, "b": 3}
    assert make_plan(groups, 5.0, NO_LIMITS, {}, {"a": 0}).counts == {"a": 0, "b": 5}
    with pytest.raises(PlanError, match="--min 3 is above its maximum 2"):
        make_plan(groups, 5.0, NO_LIMITS, {"a": 3}, {"a": 2})


def test_a_limit_of_zero_excludes_only_a_group_above_zero():
    """A limit of 0 is valid ("none at all"): a group measuring exactly 0 is within it; a strict
    comparison turned round excluded every clean group."""
    zero = Limits({**NO_LIMITS.values, "max_out_of_range": 0.0, "max_staleness": 0.0}, "test", "test")
    assert check_limits({"out_of_range": 0.0, "staleness": 0.0}, zero) == []
    assert check_limits({"out_of_range": 1e-6, "staleness": 0.0}, zero) == [
        "out_of_range 1e-06 > max_out_of_range 0"]
    groups = {"clean": _group("clean", 4.0, 1.0, staleness=0.0),
              "dirty": _group("dirty", 9.0, 1.0, out_of_range=0.01, staleness=0.0)}
    plan = make_plan(groups, 3.0, zero)
    assert plan.counts == {"clean": 3, "dirty": 0} and list(plan.excluded) == ["dirty"]
    # exactly at a positive limit is within it too
    at = Limits({**NO_LIMITS.values, "max_k3": 0.01}, "test", "test")
    assert check_limits({"k3": 0.01}, at) == [] and check_limits({"k3": 0.0100001}, at) != []


@st.composite
def _fleet(draw):
    n = draw(st.integers(1, 3))
    groups, mins, maxs = {}, {}, {}
    for i in range(n):
        name = f"g{i}"
        groups[name] = _group(name, draw(st.sampled_from([1.0, 2.0, 5.4, 6.6, 8.0])),
                              draw(st.sampled_from([1.0, 2.0, 5.0, 6.0, 7.0])),
                              out_of_range=draw(st.sampled_from([0.0, 0.0, 0.002, 0.01])))
        lo = draw(st.sampled_from([0, 0, 1, 2]))
        hi = draw(st.sampled_from([None, None, lo, lo + 1, lo + 2]))
        if lo:
            mins[name] = lo
        if hi is not None:
            maxs[name] = hi
    return groups, mins, maxs, draw(st.sampled_from([0.0, 2.0, 7.0, 10.0, 13.0]))


@settings(max_examples=80, deadline=None)
@given(_fleet(), st.sampled_from([None, 0.0, 0.002]))
def test_make_plan_is_brute_force_with_min_max_and_limits(fleet, limit):
    groups, mins, maxs, budget = fleet
    limits = Limits({**NO_LIMITS.values, "max_out_of_range": limit}, "test", "test")
    clean = {n: m for n, m in groups.items() if limit is None or m.out_of_range <= limit}
    fixed = sum(mins.get(n, 0) * groups[n].price for n in groups)
    refused = (any(mins.get(n, 0) > maxs.get(n, math.inf) for n in clean)
               or any(mins.get(n) for n in groups if n not in clean) or fixed > budget + 1e-9)
    if refused:
        with pytest.raises(PlanError):
            make_plan(groups, budget, limits, mins, maxs)
        return
    plan = make_plan(groups, budget, limits, mins, maxs)
    assert set(plan.excluded) == set(groups) - set(clean)
    want = brute_force([(n, m.rate, m.price, mins.get(n, 0), maxs.get(n)) for n, m in clean.items()], budget)
    assert plan.useful_per_hour == pytest.approx(want[0], abs=1e-7)
    assert plan.cost_per_hour == pytest.approx(want[1], abs=1e-7)
    for n in groups:
        assert mins.get(n, 0) <= plan.counts[n] <= maxs.get(n, math.inf)
        assert n in clean or plan.counts[n] == 0


def test_k3_growth_is_the_last_third_over_the_first_third(tmp_path):
    """``max_k3_growth`` judges the group's mean k3 over the run's last third against its first
    third (read from metrics.jsonl): 7 steps, thirds of 2 steps. A first third one step short
    (``steps[:third - 1]``) passed every test (mutate_human, plan.py)."""
    import json

    from experiments.plan import read_run

    k3 = [0.01, 0.03, 0.02, 0.04, 0.05, 0.06, 0.09]
    rows = [{"step": s + 1, "samples_trained": 10.0, "group/a/sample_share": 1.0, "group/a/tokens": 100.0,
             "group/a/tokens_per_s": 50.0, "group/a/k3": v, "group/a/out_of_range": 0.0,
             "group/a/dropped": 0.0, "group/a/staleness": 1.0} for s, v in enumerate(k3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    m = read_run(tmp_path)["a"]
    third = len(k3) // 3
    want = (sum(k3[-third:]) / third) / (sum(k3[:third]) / third)
    assert m.k3_growth == pytest.approx(want) and want == pytest.approx(0.075 / 0.02)


def test_plan_inputs_at_their_edges(tmp_path, capsys):
    """Survivors of the human-style mutants of plan.py, each an input a user can give: a summary
    recording 0 processes (not a replica count: the group stays at the assumed 1), a config with
    no groups: list, a plan listing two groups twice (the first by name is named), ``--help``."""
    import json

    from experiments.plan import _from_summary, plan_main
    from trainer_jax.plan_file import PlanError, plan_overrides, read_plan

    (tmp_path / "summary.json").write_text(json.dumps({"cost": {"groups": {
        "a": {"accelerator": "L4", "price_per_hour": 1.0, "processes": 0},
        "b": {"accelerator": "H100", "price_per_hour": 3.0, "processes": 2}}}}))
    groups = {"a": _group("a", 1.0, 1.0), "b": _group("b", 1.0, 1.0)}
    _from_summary(groups, tmp_path)
    assert (groups["a"].replicas, groups["a"].replicas_from) == (1.0, "assumed 1")
    assert (groups["b"].replicas, groups["b"].replicas_from) == (2.0, "summary.json")
    plan = tmp_path / "plan.yaml"
    row = "- {{name: {}, processes: 1, accelerator: L4, price_per_hour: 1.0}}\n"
    plan.write_text("groups:\n" + "".join(row.format(n) for n in ("b", "a", "b", "a")))
    with pytest.raises(PlanError, match="group 'a' is listed twice"):
        read_plan(plan)
    for text in ("model: {}\n", "groups: []\n"):
        (tmp_path / "c.yaml").write_text(text)
        with pytest.raises(PlanError, match="no groups: list to apply --plan"):
            plan_overrides(tmp_path / "c.yaml", plan)
    with pytest.raises(SystemExit):
        plan_main(["--help"])
    usage = capsys.readouterr().out
    assert usage.startswith("usage: mixrl-train plan ")
    assert "[--min GROUP=N]" in usage and "[--max GROUP=N]" in usage
