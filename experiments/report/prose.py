# ruff: noqa: E501 -- report prose reads better unbroken.
"""The written comparison with the seed write-up: one paragraph per seed finding, then a closing note.

Every claim is conditional on the numbers (``claims_outcome``, ``claims_mismatch``), so rerunning the
sweep at another scale rewrites the conclusions with it.
"""

from __future__ import annotations

from experiments.report.claims_mismatch import drift_share, mixed_kl_is_larger, out_of_range_attribution
from experiments.report.claims_outcome import (
    corrected_stays_stable,
    grpo_collapses_on_mixed,
    mixed_matches_homogeneous,
    top_p_collapse,
)
from experiments.report.grid import Grid

CLAIMS = (  # in the order of the seed write-up's findings
    grpo_collapses_on_mixed,
    top_p_collapse,
    corrected_stays_stable,
    mixed_matches_homogeneous,
    mixed_kl_is_larger,
    out_of_range_attribution,
    drift_share,
)


def closing(grid: Grid) -> str:
    """How to read the verdicts: when every cell collapsed, the grid cannot separate the objectives."""
    ok_runs = grid.ok
    if ok_runs and all(r.collapse_step is not None for r in ok_runs):
        return (
            f"Interpretation: every cell collapsed within {grid.steps} steps, so this grid does not separate the "
            "objectives: the shared settings (learning rate, no staleness cap) destabilise all of them before "
            "the sampler mismatch can matter. The next run to make is the same grid at a lower learning rate "
            "(or with train.max_staleness) for more steps and more seeds, where the corrected conditions have "
            "a chance to stay up while uncorrected GRPO on the mixed pool drifts. Where a finding is 'not "
            "reproduced' above it means 'not observable in this budget', not 'refuted'."
        )
    return (
        "Interpretation: the magnitudes here (steps, model size, reply length) are far from the seed's, so "
        "where a finding is 'not reproduced' above it means 'not observable in this budget', not 'refuted'."
    )


def comparison(grid: Grid) -> list[str]:
    """The section's markdown lines: heading, the claims the grid has the cells for, the closing note."""
    lines = [
        "## Mixed vs homogeneous, as read for the asynchronous grid (issue 8)",
        "",
        "The earlier reading, kept for comparison with `docs/results_async.md`: collapse here is the reward "
        "collapse alone, and a cell counts as having a reward signal only above 0.1; the verdicts on the seed's "
        "claims as issue 20 states them are in the section above.",
        "",
    ]
    lines += [p for claim in CLAIMS if (p := claim(grid)) is not None]
    return lines + ["", closing(grid), ""]
