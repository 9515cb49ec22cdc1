"""``init_distributed``: what it passes to ``jax.distributed.initialize`` for each config / environment.

The real multi-process path runs in test_multiprocess.py; here ``resolve`` is checked as a pure
function and ``init_distributed`` only in its single-process case.
"""

from __future__ import annotations

import pytest

from trainer_jax.config import DistributedConfig, load_config
from trainer_jax.parallel.distributed import detect_launcher, init_distributed, resolve

SLURM = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
         "SLURM_LOCALID": "0"}


@pytest.mark.parametrize("cfg, env, want, reason", [
    (DistributedConfig(), {}, None, "one process"),
    (DistributedConfig(mode="off", coordinator_address="h:1"), {}, None, "mode=off"),
    (DistributedConfig(), {"MIXRL_COORDINATOR_ADDRESS": "10.0.0.1:1234", "MIXRL_NUM_PROCESSES": "4",
                           "MIXRL_PROCESS_ID": "3"},
     dict(coordinator_address="10.0.0.1:1234", num_processes=4, process_id=3), "coordinator configured"),
    (DistributedConfig(coordinator_address="head:9000", num_processes=2, process_id=0),
     {"MIXRL_PROCESS_ID": "1"}, dict(coordinator_address="head:9000", num_processes=2, process_id=1),
     "coordinator configured"),
    (DistributedConfig(), SLURM, {}, "slurm launcher"),
    (DistributedConfig(), {**SLURM, "SLURM_NTASKS": "1"}, None, "one process"),
    (DistributedConfig(), {"TPU_WORKER_HOSTNAMES": "w0,w1,w2,w3"}, {}, "tpu launcher"),
    (DistributedConfig(mode="on"), {}, {}, "mode=on"),
    (DistributedConfig(num_processes=1), {}, None, "num_processes=1"),
    (DistributedConfig(mode="on", local_device_ids=[0, 1]), {"MIXRL_LOCAL_DEVICE_IDS": "2,3"},
     dict(local_device_ids=[2, 3]), "mode=on"),
])
def test_resolve(cfg, env, want, reason):
    kwargs, why = resolve(cfg, env)
    assert reason in why
    if want is None:
        assert kwargs is None
    else:
        assert kwargs == {**want, "initialization_timeout": cfg.initialization_timeout_s,
                          "heartbeat_timeout_seconds": max(100, 2 * cfg.heartbeat_timeout_s + 10)}


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="MIXRL_NUM_PROCESSES"):
        resolve(DistributedConfig(), {"MIXRL_NUM_PROCESSES": "two"})
    with pytest.raises(ValueError, match="outside"):
        resolve(DistributedConfig(), {"MIXRL_NUM_PROCESSES": "2", "MIXRL_PROCESS_ID": "2"})
    with pytest.raises(ValueError, match="HOST:PORT"):
        DistributedConfig(coordinator_address="nohost")
    with pytest.raises(ValueError, match="below num_processes"):
        DistributedConfig(num_processes=2, process_id=2)


def test_launcher_detection_is_env_only():
    assert detect_launcher({}) is None
    assert detect_launcher({"OMPI_COMM_WORLD_SIZE": "8"}) == "openmpi"
    assert detect_launcher({"TPU_WORKER_HOSTNAMES": "localhost"}) is None  # a single-host TPU VM


def test_single_process_is_a_no_op(tmp_path):
    cfg = load_config(None, ["distributed.mode=auto"])
    info = init_distributed(cfg.distributed, env={})
    assert not info.initialized and info.process_count == 1 and info.process_index == 0
