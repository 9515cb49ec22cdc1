# ruff: noqa: E501 -- report prose reads better unbroken.
"""Claims 1–3 of the comparison with the seed write-up: whether training collapsed, where, and
whether the corrected objective makes the mixed pool match the homogeneous one.

Each function returns its numbered paragraph, or None when the grid lacks the cells it needs; the
verdict in each is chosen by the numbers.
"""

from __future__ import annotations

import math

from experiments.report.grid import Grid
from experiments.report.runs import REWARD_FLOOR, mean_over_seeds, nanmean
from experiments.report.tables import fmt

_CORRECTED = ("sc_mis", "sc_mis_topp")
_CLAIM_1 = "1. **GRPO collapses on mixed samplers"


def _brief(grid: Grid, pool: str, cond: str) -> str:
    """One cell's outcome in words, for the contrasts after a verdict ("" if no run finished)."""
    rs = grid.runs(pool, cond)
    if not rs:
        return ""
    n_c = sum(r.collapse_step is not None for r in rs)
    n_k = sum(r.kl_alarm_step is not None for r in rs)
    return (
        f"{grid.label(cond)} / {pool}: reward collapse {n_c}/{len(rs)}, KL alarm {n_k}/{len(rs)}, "
        f"k3 last/first third {fmt(nanmean([r.k3_growth for r in rs]), '.1f')}x, held-out pass@1 "
        f"{fmt(nanmean([r.eval_start for r in rs]))} → {fmt(nanmean([r.eval_final for r in rs]))}"
    )


def _contrast(grid: Grid) -> str:
    """Every cell's ``_brief``, condition-major, joined into one sentence part."""
    return "; ".join(b for b in (_brief(grid, p, c) for c in grid.conds for p in grid.pools) if b)


def grpo_collapses_on_mixed(grid: Grid) -> str | None:
    """Claim 1: did uncorrected GRPO on the mixed pool collapse, and is that specific to it?

    Not assessable without a reward signal; not specific when every other cell collapsed too;
    ambiguous when a control (homogeneous GRPO, a corrected objective on mixed) collapsed; else
    reproduced or not.
    """
    n, tot = grid.collapsed("mixed", "grpo")
    if not tot:
        return None
    steps = grid.steps
    if not grid.signal(grid.runs("mixed", "grpo")):
        return (
            f"{_CLAIM_1} — not assessable here**: uncorrected GRPO on the mixed pool "
            f"never had a training reward above {5 * REWARD_FLOOR} in {steps} steps, so there was nothing to "
            "collapse from (with all rewards equal GRPO's advantages are zero and the update is empty)."
        )
    others = [r for r in grid.ok if not (r.pool == "mixed" and r.condition == "grpo")]
    others_collapsed = sum(r.collapse_step is not None for r in others)
    if n and others and others_collapsed == len(others):
        return (
            f"{_CLAIM_1} — not reproduced as a GRPO/mixed-specific effect**: "
            f"uncorrected GRPO on the mixed pool collapsed in {n}/{tot} seeds within {steps} steps, but so did "
            f"every other cell ({others_collapsed}/{len(others)}, corrected objectives and the homogeneous pool "
            "included), so in this budget the collapse comes from something all cells share (the raised "
            "learning rate and the stale samples it makes off-policy), not from the sampler mismatch that "
            "the corrections target. Per cell: " + _contrast(grid) + "."
        )
    if n and (grid.collapsed("homogeneous", "grpo")[0] or any(grid.collapsed("mixed", c)[0] for c in _CORRECTED)):
        return (
            f"{_CLAIM_1} — ambiguous**: uncorrected GRPO on the mixed pool "
            f"collapsed in {n}/{tot} seeds within {steps} steps, but so did at least one control (GRPO on "
            "the homogeneous pool or a corrected objective on the mixed pool), so the collapse is not "
            "attributable to the sampler mismatch alone. Per cell: " + _contrast(grid) + "."
        )
    if n:
        return (
            f"{_CLAIM_1} — reproduced** in {n}/{tot} seeds within {steps} steps "
            f"(first at step {grid.first_collapse('mixed', 'grpo')}). "
            "Whether this is the mismatch and not the learning rate is told by the other cells, "
            "which ran the same rule: " + _contrast(grid) + "."
        )
    g = grid.runs("mixed", "grpo")
    growth = nanmean([r.k3_growth for r in g])
    gn = nanmean([r.max_grad_norm for r in g])
    return (
        f"{_CLAIM_1} — not reproduced at this scale**: in {tot} seed(s) of "
        f"{steps} RL steps the reward of uncorrected GRPO on the mixed pool did not fall to ~0 and the "
        f"reward alarm did not fire. What the runs do show: k3 in the last third of training is "
        f"{fmt(growth, '.2f')}x its first-third level, max grad norm {fmt(gn, '.3g')}. The seed's collapse "
        f"came after hundreds of steps of long-horizon agentic RL (256K context) on a large model, where "
        f"drift compounds over many updates; a tiny char-level model trained for a few dozen steps with "
        f"short replies gives it neither the horizon nor the update count. What it would take: many "
        f"more steps at a higher learning rate, longer generations (the per-token drift sums over the "
        f"sequence), and more aggressive low-precision recipes. All cells: " + _contrast(grid) + "."
    )


def top_p_collapse(grid: Grid) -> str | None:
    """Claim 1, continued: where the mismatch is large by construction (top-p sampling scored against
    the full softmax), uncorrected GRPO collapsed on the mixed pool and SC + MIS with mask replay did
    not. Written only when that is what happened."""
    nt, tt = grid.collapsed("mixed", "grpo_topp")
    nr, tr = grid.collapsed("mixed", "sc_mis_topp")
    if not (tt and tr and nt and not nr):
        return None
    nh, th = grid.collapsed("homogeneous", "grpo_topp")
    k3_start = ", ".join(
        f"{p} {fmt(mean_over_seeds(grid.runs(p, 'grpo_topp'), 'k3_start'), '.2e')} vs "
        f"{fmt(mean_over_seeds(grid.runs(p, 'grpo'), 'k3_start'), '.2e')}"
        for p in grid.pools
        if grid.runs(p, "grpo_topp") and grid.runs(p, "grpo")
    )
    replay, uncorrected = grid.runs("mixed", "sc_mis_topp"), grid.runs("mixed", "grpo_topp")
    return (
        "   Where the mismatch is large by construction it does reproduce: with top-p 0.9 sampling scored "
        "against the trainer's full softmax and no correction (GRPO + top-p; k3 over the first two steps, "
        "truncated vs untruncated sampling: "
        + k3_start
        + f") the reward collapsed in {nt}/{tt} seeds on the mixed pool (first at step "
        f"{grid.first_collapse('mixed', 'grpo_topp')})"
        + (f" and {nh}/{th} on the homogeneous one" if th else "")
        + f", while the same sampling with SC + MIS and mask replay collapsed in {nr}/{tr} (held-out pass@1 "
        f"{fmt(mean_over_seeds(replay, 'eval_start'))} → "
        f"{fmt(mean_over_seeds(replay, 'eval_final'))} against "
        f"{fmt(mean_over_seeds(uncorrected, 'eval_final'))} uncorrected)."
    )


def corrected_stays_stable(grid: Grid) -> str | None:
    """Claim 2: no seed of SC + MIS (with or without top-p replay) collapsed on the mixed pool."""
    stable = [(c, grid.collapsed("mixed", c)) for c in _CORRECTED if grid.runs("mixed", c)]
    if not stable:
        return None
    desc = ", ".join(f"{grid.label(c)}: {n}/{t} seeds collapsed" for c, (n, t) in stable)
    verdict = "held" if all(n == 0 for _, (n, _t) in stable) else "did NOT hold"
    return f"2. **SC + MIS (+ top-p replay) stays stable on the mixed pool — {verdict}** ({desc})."


def _matching_verdict(grid: Grid, corrected: list[str], gaps: list[float]) -> str:
    """Claim 3's verdict from the pool gaps of final pass@1 under the corrected conditions."""
    corrected_runs = [r for c in corrected for r in grid.runs("mixed", c) + grid.runs("homogeneous", c)]
    if not grid.signal(corrected_runs):
        return "not assessable (no run had a reward signal)"
    if corrected_runs and all(r.collapse_step is not None for r in corrected_runs):
        return (
            "not evidence either way (both pools collapsed under the corrected objective too, so they "
            "match only in failing)"
        )
    if gaps and max(gaps) <= 0.05:
        return "consistent with the seed (gap ≤ 0.05)"
    if gaps:
        return "not established (gap > 0.05, within the noise of so few evaluation tasks and seeds)"
    return "not measurable"


def mixed_matches_homogeneous(grid: Grid) -> str | None:
    """Claim 3: under the corrected objective (or every condition, when none of it ran in both pools),
    final held-out pass@1 and last-third reward of the two pools, with the samples' staleness."""
    pairs = []  # (condition, final pass@1 mixed, homogeneous, last-third reward mixed, homogeneous)
    for c in grid.conds:
        m, h = grid.runs("mixed", c), grid.runs("homogeneous", c)
        if m and h:
            pairs.append(
                (
                    c,
                    nanmean([r.eval_final for r in m]),
                    nanmean([r.eval_final for r in h]),
                    nanmean([r.reward_last for r in m]),
                    nanmean([r.reward_last for r in h]),
                )
            )
    if not pairs:
        return None
    corrected = [p for p in pairs if p[0] in _CORRECTED] or pairs
    gaps = [abs(a - b) for _, a, b, _, _ in corrected if not (math.isnan(a) or math.isnan(b))]
    text = "; ".join(
        f"{grid.label(c)}: final pass@1 mixed {fmt(a)} vs homogeneous {fmt(b)}, last-third "
        f"reward {fmt(ra)} vs {fmt(rb)}"
        for c, a, b, ra, rb in corrected
    )
    verdict = _matching_verdict(grid, [c for c, *_ in corrected], gaps)
    stale_by_pool = {p: nanmean([r.mean_staleness for r in grid.ok if r.pool == p]) for p in grid.pools}
    return (
        f"3. **Mixed matches homogeneous under the corrected objective — {verdict}**: {text}. "
        f"With few held-out tasks and seeds, differences of a few points are noise. Both pools ran with "
        f"the same trajectory-buffer bound, so their samples were equally stale (mean "
        + ", ".join(f"{p} {fmt(v, '.2f')}" for p, v in stale_by_pool.items())
        + " weight versions): a pool whose samplers run further ahead of the learner trains on "
        "staler samples, a mismatch of its own."
    )
