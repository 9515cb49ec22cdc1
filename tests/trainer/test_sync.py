"""Synchronous mode (``train.sync``): the version gate in front of the rollout service.

A real service on loopback and a real client; trajectories are synthetic but valid
(tests/service/fakes.py). The end-to-end run (staleness 0 in the metrics) is the sync cell of the
quick sweep in tests/trainer/test_sweep.py.
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
