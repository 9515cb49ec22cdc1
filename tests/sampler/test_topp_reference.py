"""The sampler's kept set (top-k and top-p) against a plain sorted-list implementation written
here (issue 46): each binding alone and together, ties, values exactly at the limit, one-token
vocabularies, top-k at and past the vocabulary, and generated batches whose rows differ.

The rule (``sampler_torch/engine/sampling.py``, SGLang's ``top_k_top_p``): sort q descending,
ties in vocabulary order; keep rank r when ``r < top_k`` (top-k on) and the mass *before* it is
``<= top_p``; rank 0 always. The input to the rule, q, is computed as the module defines it
(``log_softmax`` of the float32 logits over T, then ``exp`` in float64); the rule itself is
re-implemented below with Python lists and floats only.
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import example, given, settings

from sampler_torch.engine.sampling import sample_step


def _q(logits: list[float], temperature: float) -> list[float]:
    t = 1.0 if temperature <= 0 else temperature
    return (torch.log_softmax(torch.tensor([logits], dtype=torch.float32) / t, dim=-1)
            .double().exp()[0].tolist())


def kept_reference(q: list[float], top_p: float, top_k: int, temperature: float) -> list[int]:
    """The kept ids in sorted order: a plain loop over a sorted list."""
    vocab = len(q)
    if temperature <= 0:
        top_k = 1  # greedy: top-k 1
    if top_k <= 0 or top_k >= vocab:
        top_k = 0  # off
    order = sorted(range(vocab), key=lambda i: (-q[i], i))
    kept, running = [], 0.0
    for rank, i in enumerate(order):
        running += q[i]
        before = running - q[i]  # the mass before this rank, as SGLang's probs_sum - probs_sort
        # top_p 1 is off (the mass before a token can round past 1.0: it must not cut there)
        if rank > 0 and ((top_k and rank >= top_k) or (top_p < 1 and before > top_p)):
            break
        kept.append(i)
    return kept


def _run(rows: list[tuple[list[float], float, float, int]], seed: int = 0):
    """sample_step on a batch of (logits, temperature, top_p, top_k) rows; top_p in float64 so a
    limit taken from the reference's own mass is compared exactly."""
    logits = torch.tensor([r[0] for r in rows], dtype=torch.float32)
    temp = torch.tensor([r[1] for r in rows], dtype=torch.float32)
    top_p = torch.tensor([r[2] for r in rows], dtype=torch.float64)
    top_k = torch.tensor([r[3] for r in rows], dtype=torch.long)
    u = torch.tensor([(seed * 7919 + 13 * i) % 1000 / 1000 for i in range(len(rows))], dtype=torch.float64)
    return sample_step(logits, temp, top_p, top_k, 0, u)


def _kept(rec, row: int) -> list[int]:
    n = int(rec.support_len[row])
    return rec.support_ids[row, :n].tolist() if n else []


def _check(rows, seed: int = 0) -> None:
    rec = _run(rows, seed)
    for i, (logits, temp, top_p, top_k) in enumerate(rows):
        q = _q(logits, temp)
        want = kept_reference(q, top_p, top_k, temp)
        k = 1 if temp <= 0 else top_k
        if top_p < 1 or 0 < k < len(q):  # truncating: the kept set is recorded, in sorted order
            assert _kept(rec, i) == want, (i, logits, temp, top_p, top_k, _kept(rec, i), want)
        else:  # nothing truncated: no support recorded, and the rule keeps every token too
            assert int(rec.support_len[i]) == 0 and sorted(want) == list(range(len(q)))
        token = int(rec.tokens[i])
        assert token in want, (i, token, want)
        if int(rec.support_len[i]):  # b = q / q(S) on the kept set
            mass = sum(q[j] for j in want)
            assert float(rec.logprob[i]) == pytest.approx(math.log(q[token] / mass), abs=2e-5)
        assert int((rec.support_ids[i] >= 0).sum()) == int(rec.support_len[i])


def test_top_p_keeps_the_token_that_crosses_it_with_top_k_off():
    """Issue 46: .5 / .3 / .2 at top_p .6 keeps {0, 1} (the mass before token 1 is .5 <= .6);
    with ``cumsum`` for ``cumsum - p`` the kept set was {0}."""
    logits = [math.log(0.5), math.log(0.3), math.log(0.2)]
    rec = _run([(logits, 1.0, 0.6, 0)])
    assert _kept(rec, 0) == [0, 1] == kept_reference(_q(logits, 1.0), 0.6, 0, 1.0)
    rec = _run([(logits, 1.0, 0.49, 0)])  # below the first token's mass: that token alone
    assert _kept(rec, 0) == [0]
    rec = _run([(logits, 1.0, 0.81, 0)])  # past .5 + .3: all three
    assert int(rec.support_len[0]) == 3


def test_top_p_exactly_at_the_mass_before_a_token_keeps_it():
    """The limit itself: the mass before rank 1 equal to top_p keeps rank 1 (``<=``)."""
    logits = [math.log(0.5), math.log(0.3), math.log(0.2)]
    q = _q(logits, 1.0)
    p0, p1 = sorted(q, reverse=True)[:2]
    at = (p0 + p1) - p1  # the mass before rank 1 as the rule computes it
    assert _kept(_run([(logits, 1.0, at, 0)]), 0) == [0, 1]
    assert _kept(_run([(logits, 1.0, math.nextafter(at, 0.0), 0)]), 0) == [0]
    assert kept_reference(q, at, 0, 1.0) == [0, 1]


def test_top_k_and_top_p_each_binding_alone_and_together():
    logits = [2.0, 1.5, 1.0, 0.5, 0.0, -0.5]
    q = _q(logits, 1.0)
    cases = [(0.95, 2), (0.3, 5), (0.999, 0), (1.0, 3), (0.0, 4), (1.0, 1), (1.0, 6), (1.0, 7), (0.5, -1)]
    rows = [(logits, 1.0, p, k) for p, k in cases]
    _check(rows)
    rec = _run(rows)
    assert _kept(rec, 0) == [0, 1]        # top-k binds first
    assert len(_kept(rec, 1)) < 5          # top-p binds first
    assert _kept(rec, 4) == [0]            # top_p 0: the first token alone
    assert int(rec.support_len[6]) == int(rec.support_len[7]) == 0  # k >= vocab: off, no truncation
    assert kept_reference(q, 1.0, 6, 1.0) == list(range(6))


def test_ties_keep_vocabulary_order_and_top_k_cuts_inside_a_tie():
    logits = [0.0, 1.0, 1.0, 1.0, 0.0, 1.0]
    rec = _run([(logits, 1.0, 1.0, 2), (logits, 1.0, 1.0, 3), (logits, 0.0, 1.0, 0), (logits, 1.0, 0.3, 0)])
    assert _kept(rec, 0) == [1, 2]
    assert _kept(rec, 1) == [1, 2, 3]
    assert _kept(rec, 2) == [1] and int(rec.tokens[2]) == 1  # greedy: the first of the tied maxima
    assert _kept(rec, 3) == [1, 2]  # each tied token holds .2: mass before the second is .2 <= .3


def test_ties_under_top_k_alone_keep_vocabulary_order():
    """Every row on top-k takes the top-k shortcut (``topk``), which orders ties arbitrarily: it
    kept ids 2, 3 of four equal logits at top-k 2, and a greedy row could pick any tied maximum."""
    rec = _run([([1.0, 1.0, 1.0, 1.0, 1.0], 1.0, 1.0, 2), ([0.0, 2.0, 2.0, 1.0, 2.0], 0.0, 1.0, 0),
                ([5.0, 1.0, 1.0, 1.0, 1.0], 1.0, 1.0, 3)])
    assert _kept(rec, 0) == [0, 1]
    assert _kept(rec, 1) == [1] and int(rec.tokens[1]) == 1
    assert _kept(rec, 2) == [0, 1, 2]


def test_a_one_token_vocabulary_and_a_uniform_distribution():
    _check([([3.0], 1.0, 0.5, 1), ([3.0], 0.0, 0.0, 0), ([3.0], 1.0, 1.0, 0)])
    uniform = [0.0] * 8
    _check([(uniform, 1.0, p, k) for p, k in ((0.25, 0), (0.5, 3), (0.0, 0), (0.99, 8))])


_logit = st.one_of(st.sampled_from([-1.0, 0.0, 0.0, 1.0, 2.0]),
                   st.floats(-6, 6, allow_nan=False, width=32))


@st.composite
def _batch(draw):
    vocab = draw(st.integers(1, 10))
    rows = []
    for _ in range(draw(st.integers(1, 4))):
        rows.append((draw(st.lists(_logit, min_size=vocab, max_size=vocab)),
                     draw(st.sampled_from([0.0, 0.5, 1.0, 1.7])),
                     draw(st.one_of(st.sampled_from([0.0, 0.5, 0.9, 1.0]), st.floats(0, 1))),
                     draw(st.integers(-1, vocab + 1))))
    return rows


@settings(max_examples=60, deadline=None)
@given(_batch(), st.integers(0, 10_000))
@example([([math.log(0.5), math.log(0.3), math.log(0.2)], 1.0, 0.6, 0)], 0)
@example([([1.0, 1.0, 1.0, 1.0], 1.0, 0.6, 2), ([0.0, 3.0, 1.0, 2.0], 1.0, 1.0, 0)], 1)
@example([([2.0, 6.0, -3.0], 0.5, 1.0, 0)], 0)
def test_the_kept_set_is_the_sorted_list_rule_on_generated_batches(rows, seed):
    _check(rows, seed)
