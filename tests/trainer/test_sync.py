"""Synchronous mode (``train.sync``): the version gate in front of the rollout service.

A real service on loopback and a real client; trajectories are synthetic but valid
(tests/service/fakes.py). The end-to-end run (staleness 0 in the metrics) is the sync cell of the
quick sweep in tests/experiments/test_sweep.py.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "service"))
from fakes import fake_trajectory  # noqa: E402

from sampler_torch.client import Backoff, RolloutClient  # noqa: E402
from trainer_jax.config import ConfigError, load_config  # noqa: E402
from trainer_jax.service import RolloutService  # noqa: E402
from trainer_jax.service.tasks import build_task_source  # noqa: E402
from trainer_jax.sync import SyncTasks, all_of_version  # noqa: E402

TOKEN = "sync-token"
BASE = ["service.listen=127.0.0.1:0", "tasks.group_size=2", "tasks.sampling.max_new_tokens=8",
        "tasks.sampling.head_k=4", "train.sync=true", "train.prompts_per_step=2"]


@pytest.fixture
def gated():
    cfg = load_config(None, BASE)
    gate = SyncTasks(build_task_source(cfg.tasks), cfg.train.prompts_per_step)
    service = RolloutService.from_config(cfg, token=TOKEN, source=gate).start()
    yield service, gate
    service.stop(grace=0)


def _submit_all(client, tasks, vocab, version, rng):
    acks = client.submit_many([fake_trajectory(t, i, vocab, rng, version=version)
                               for t in tasks for i in t.sample_indices])
    assert all(a.accepted for a in acks), [a.reason for a in acks]


def test_tasks_of_a_version_go_only_to_samplers_holding_it_and_p_per_version(gated):
    svc, gate = gated
    rng = np.random.default_rng(0)
    client = RolloutClient(svc.address, TOKEN, group="bf16", capacity=8, name="s0",
                           backoff=Backoff(initial_s=0.01, max_s=0.1), max_retry_s=3.0)
    client.register()
    empty = client.lease(8)
    assert not empty.tasks and empty.reason != "no more tasks"  # gated, not exhausted
    gate.release(0)
    tasks = list(client.lease(8).tasks)
    assert len(tasks) == 2  # exactly P prompts of version 0, then nothing more
    assert not client.lease(8).tasks
    _submit_all(client, tasks, svc.vocab_size, 0, rng)
    groups = gate.take(lambda k: svc.buffer.take_groups(k, timeout=5.0), 2, 0)
    assert len(groups) == 2 and all(all_of_version(g, 0) for g in groups)

    gate.release(1)
    client.heartbeat(weights_version=0)
    refused = client.lease(8)
    assert not refused.tasks and "weights version" in refused.reason
    client.heartbeat(weights_version=1)
    tasks = list(client.lease(8).tasks)
    assert len(tasks) == 2
    assert svc.status()["totals"].get("accepted") == 4


def test_a_group_with_a_token_of_another_version_is_dropped_and_replaced():
    def group(*versions):
        return SimpleNamespace(trajectories=[SimpleNamespace(versions=np.asarray(v)) for v in versions])

    released = []
    gate = SyncTasks(source=None, prompts_per_step=2)
    gate.release = lambda version, count=None: released.append((version, count))
    batches = [[group([3, 3], [3]), group([3, 2], [3])], [group([3], [3, 3])]]
    kept = gate.take(lambda k: batches.pop(0), 2, 3)
    assert len(kept) == 2 and all(all_of_version(g, 3) for g in kept)
    assert gate.dropped_groups == 1 and released == [(3, 1)]


def test_sync_needs_a_publish_every_step():
    with pytest.raises(ConfigError, match="publish_every must be 1"):
        load_config(None, ["train.sync=true", "train.publish_every=2"])


# ------------------------------------------------------------------ the sweeps of issue 20

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def test_sync_and_dial_sweeps_set_their_pools_by_override(tmp_path):
    from experiments.sweep import cells, load_sweep

    def config(cell):
        return load_config(cell.config, [o for o in cell.overrides if not o.startswith("model.hf_dir")])

    sync = load_sweep(ROOT / "configs" / "ablation_sync.yaml")
    assert list(sync.conditions) == ["grpo", "sc_mis", "sc_mis_topp"]
    assert list(sync.pools) == ["homogeneous", "mixed", "aggressive"] and sync.seeds == [0, 1]
    grid = cells(sync, tmp_path)
    assert len(grid) == 18
    aggressive = config(next(c for c in grid if c.pool == "aggressive"))
    assert aggressive.train.sync and aggressive.tasks.mix[0].env == "chain"
    assert {(g.recipe, g.kv_cache_dtype) for g in aggressive.groups} == {("nvfp4_w4a4", "fp8_e5m2")}
    assert len(aggressive.groups) == 4

    dial = load_sweep(ROOT / "configs" / "ablation_dial.yaml")
    grid = cells(dial, tmp_path)
    assert len(grid) == 16 and list(dial.conditions) == ["grpo", "sc_mis"]
    sigmas = {c.pool: {g.logit_noise for g in config(c).groups} for c in grid}
    assert sorted(s for (s,) in sigmas.values()) == [0.1, 0.3, 1.0, 3.0]
    assert all(config(c).train.sync for c in grid)

    # The dial at the long grid's setting: the same shared overrides (so its sigma 0 is that grid's
    # homogeneous pool and the warm starts are the same), the pools differing only by the noise.
    long, dial_long = (load_sweep(ROOT / "configs" / f"ablation_{n}.yaml") for n in ("long", "dial_long"))
    assert dial_long.overrides == long.overrides and dial_long.conditions == long.conditions
    grid = cells(dial_long, tmp_path)
    assert len(grid) == 12
    homogeneous = load_config(ROOT / "configs" / "local_homogeneous.yaml").groups
    # device aside: the shipped pools now say device: cpu (their prices are illustrative there),
    # the dial's archived groups predate that and resolve auto to this same CPU.
    same = {"logit_noise": None, "device": "auto"}
    for c in grid:
        groups = config(c).groups
        assert [g.model_copy(update=same) for g in groups] == [g.model_copy(update=same) for g in homogeneous]
    sigmas = {c.pool: {g.logit_noise for g in config(c).groups} for c in grid}
    assert sorted(s for (s,) in sigmas.values()) == [0.3, 1.0, 3.0]


def test_quick_dial_sweep_runs_sync_mode_end_to_end(tmp_path):
    """The CI smoke test of the new modes: a warm start and 2 sync steps on `chain` with sigma 1."""
    import json
    import subprocess

    out = tmp_path / "runs"
    proc = subprocess.run([BIN / "mixrl-train", "sweep", str(ROOT / "configs" / "ablation_dial.yaml"),
                           "--quick", "--out", str(out), "--no-report"],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (cell,) = json.loads((out / "sweep.json").read_text())["cells"]
    assert cell["ok"], cell.get("log_tail")
    run = out / "sigma1.0" / "grpo" / "seed0"
    steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert [r["version"] for r in steps] == [0, 1]  # step s trains on version s-1's samples...
    assert all(r["staleness"] == 0 for r in steps)  # ...and only on them
    assert all(r["sync/dropped_groups_total"] == 0 for r in steps)
    assert all(r["k3"] > 0.05 for r in steps)  # the trainer measures the sigma-1 perturbation
