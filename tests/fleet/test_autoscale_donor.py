"""The autoscaler's choice of donor and receiver (``fleet.autoscale.decide``) against a reference
written here from its docstring (issue 46): the worst group gives, not the least bad; the bounds
``min_processes`` / ``max_processes`` and ``shrink_at`` exactly at their values; ties; groups
with no price, no replicas or nothing measured.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from fleet.autoscale import SHRINK_AT, GroupSignal, decide


def reference(groups: list[GroupSignal], shrink_at: float = SHRINK_AT) -> tuple[str, str] | None:
    """(donor, receiver): the donor is the group above its minimum with the largest share of its
    samples masked or of its slots idle, at least ``shrink_at`` (the first listed on a tie); the
    receiver, among groups below their maximum that are not at or past ``shrink_at`` themselves,
    the one with the most useful tokens/s per replica per USD/h (per replica when unpriced; the
    first listed on a tie)."""
    def bad(g: GroupSignal) -> float:
        masked = 0.0 if g.useful_share is None else 1.0 - g.useful_share
        return max(masked, g.idle_share or 0.0)

    donor = None
    for g in groups:
        if g.replicas > g.lo and bad(g) >= shrink_at and (donor is None or bad(g) > bad(donor)):
            donor = g
    if donor is None:
        return None
    receiver, best = None, None
    for g in groups:
        if bad(g) >= shrink_at or g.replicas >= g.hi or g.tokens_per_s is None or g.replicas <= 0:
            continue
        value = g.tokens_per_s * (1.0 if g.useful_share is None else g.useful_share) / g.replicas
        value /= g.price or 1.0
        if best is None or value > best:
            receiver, best = g, value
    return None if receiver is None else (donor.name, receiver.name)


def _pair(move) -> tuple[str, str] | None:
    return None if move is None else (move.donor, move.receiver)


def test_the_most_masked_group_gives_the_replica_not_the_least_bad():
    """Issue 46: a 90 %-masked group and a 60 %-idle one: the replica comes from the first. With
    the donors' order flipped it came from the least-bad group."""
    groups = [GroupSignal("idle", 3, 1, 4, 1.0, tokens_per_s=100.0, useful_share=1.0, idle_share=0.6),
              GroupSignal("masked", 3, 1, 4, 1.0, tokens_per_s=100.0, useful_share=0.1, idle_share=0.0),
              GroupSignal("good", 2, 1, 4, 2.0, tokens_per_s=100.0, useful_share=0.95, idle_share=0.05)]
    move = decide(groups)
    assert _pair(move) == ("masked", "good") == reference(groups)
    assert "masked is 90% masked" in move.why
    groups[1].replicas = 1  # at its minimum: the idle one gives instead
    assert _pair(decide(groups)) == ("idle", "good")


def test_limits_exactly_at_their_values():
    def g(name, replicas=2, lo=1, hi=4, idle=0.0, tps=100.0, price=1.0):
        return GroupSignal(name, replicas, lo, hi, price, tokens_per_s=tps, useful_share=1.0, idle_share=idle)

    assert _pair(decide([g("a", idle=0.5), g("b")])) == ("a", "b")  # exactly shrink_at: gives
    assert decide([g("a", idle=0.4999), g("b")]) is None
    assert decide([g("a", idle=0.9, replicas=1, lo=1), g("b")]) is None  # at its minimum
    assert decide([g("a", idle=0.9), g("b", replicas=4, hi=4)]) is None  # receiver at its maximum
    assert decide([g("a", idle=0.9), g("b", idle=0.5)]) is None  # the only other group is bad too
    assert decide([g("a", idle=0.9), g("b", tps=None)]) is None  # nothing measured
    assert decide([g("a", idle=0.9), g("b", replicas=0)]) is None  # no replica: no rate per replica
    # no price: per replica (b: 25 per replica; c: 22.5 per replica per USD/h)
    assert _pair(decide([g("a", idle=0.9), g("b", price=None, tps=50.0), g("c", price=2.0, tps=90.0)])) \
        == ("a", "b")
    assert decide([]) is None


_share = st.one_of(st.none(), st.sampled_from([0.0, 0.1, 0.5, 0.6, 0.9, 1.0]), st.floats(0, 1))


@st.composite
def _groups(draw):
    out = []
    for i in range(draw(st.integers(1, 5))):
        lo = draw(st.integers(0, 2))
        hi = draw(st.integers(lo, 5))
        out.append(GroupSignal(f"g{i}", draw(st.integers(0, 5)), lo, hi,
                               draw(st.sampled_from([None, 0.0, 1.0, 2.5])),
                               tokens_per_s=draw(st.one_of(st.none(), st.sampled_from([0.0, 50.0, 100.0]))),
                               useful_share=draw(_share), idle_share=draw(_share)))
    return out


@settings(max_examples=200, deadline=None)
@given(_groups(), st.sampled_from([SHRINK_AT, 0.0, 0.6, 1.0]))
def test_decide_is_the_reference_on_generated_fleets(groups, shrink_at):
    assert _pair(decide(groups, shrink_at)) == reference(groups, shrink_at)


def test_the_receiver_is_chosen_by_useful_tokens_not_all_tokens():
    """b accepts more tokens but keeps 60 % of them (60 useful/s), c keeps all of 80: c receives.
    Counting every token (the useful share dropped) gave the replica to b (mutate_human)."""
    groups = [GroupSignal("masked", 3, 1, 4, 1.0, tokens_per_s=100.0, useful_share=0.1),
              GroupSignal("b", 2, 1, 4, 1.0, tokens_per_s=200.0, useful_share=0.6),
              GroupSignal("c", 2, 1, 4, 1.0, tokens_per_s=160.0, useful_share=1.0)]
    assert _pair(decide(groups)) == ("masked", "c") == reference(groups)
    groups[2].useful_share = None  # unknown: taken as 1 (nothing known to be masked)
    assert _pair(decide(groups)) == ("masked", "c")
