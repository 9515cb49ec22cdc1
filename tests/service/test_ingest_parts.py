"""``bench_transport.py --parts``: the per-part split of the service's Python time per trajectory.

A small run (2 rounds of 16 trajectories) of the real lease and submit paths in process: every
part is measured, each part lies within the total it belongs to, and every trajectory was
accepted (a refusal raises), so the figures are of the accepting path the benchmark times.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_parts_are_measured_and_lie_within_their_totals():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_transport
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    import trainer_jax.service.server as server_mod
    from trainer_jax.service.scheduler import Scheduler

    before = (Scheduler.begin_submit, Scheduler.finish_submit, server_mod.validate_trajectory)
    args = argparse.Namespace(tokens=256, k=4, clients=1)
    parts = bench_transport.ingest_parts(args, rounds=2, per_round=16)
    # The timing wrappers are gone again: later tests in this process run the service as it is.
    assert (Scheduler.begin_submit, Scheduler.finish_submit, server_mod.validate_trajectory) == before
    submit = ("decode", "validate", "score", "lease checks (begin_submit)", "commit (finish_submit)")
    assert set(parts) == {*submit, "submit total", "lease total", "lease: task generation"}
    for r in range(2):
        assert all(parts[p][r] > 0 for p in ("validate", "submit total", "lease total"))
        assert sum(parts[p][r] for p in submit) <= parts["submit total"][r]
        assert parts["lease: task generation"][r] <= parts["lease total"][r]
