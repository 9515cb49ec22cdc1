"""`mixrl-fleet replica` (what a rendered Deployment / SkyPilot task runs): with nothing on the
node, it fetches the trainer's current version over gRPC, then becomes `mixrl-sample` (exec: the
same pid) and submits."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sampler_torch.engine", reason="the sampler engine is needed for a real sampler")
sys.path.insert(0, str(Path(__file__).parents[1] / "service"))  # tiny.py
from tiny import tiny_char_model  # noqa: E402

from trainer_jax.config import load_config  # noqa: E402
from trainer_jax.service import RolloutService  # noqa: E402

TOKEN = "fleet-replica-token"


def test_replica_fetches_the_current_version_then_runs_the_sampler(tmp_path):
    from convert.publish import publish

    cfg = load_config(None, ["service.listen=127.0.0.1:0", "tasks.group_size=2",
                             "tasks.sampling.max_new_tokens=4", "groups=[{name: g, spawn: false}]"])
    svc = RolloutService.from_config(cfg, token=TOKEN).start()
    try:
        pub = tmp_path / "pub"
        svc.publish_version(0, publish(tiny_char_model(tmp_path / "init"), None, pub, 0, ["bf16"]))
        svc.publish_version(3, publish(tiny_char_model(tmp_path / "init2", seed=1), None, pub, 3, ["bf16"]))
        weights = tmp_path / "node-cache"
        r = subprocess.run(
            [str(Path(sys.executable).parent / "mixrl-fleet"), "replica", "--trainer", svc.address,
             "--weights-dir", str(weights), "--weights-transfer", "fetch", "--",
             "--group", "g", "--recipe", "bf16", "--name", "r0", "--threads", "1", "--capacity", "2",
             "--max-samples", "2", "--compile", "off", "--weights-cache", str(tmp_path / "cache")],
            env={**os.environ, "MIXRL_TOKEN": TOKEN}, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "starting from version 3" in r.stdout, r.stdout
        # the fetched copy under the node's cache, not the trainer's directory
        assert str(weights) in r.stdout and str(pub) not in r.stdout.split("starting from")[1]
        samplers = {s["name"]: s for s in svc.status()["samplers"]}
        assert samplers["r0"]["accepted"] >= 2
    finally:
        svc.stop(grace=0)
