"""A fleet replica stopped while it fetches its first weights leaves no files behind: ``stop``
removes its directory, and a fetch that finishes after that must not leave a weights copy (no
pid file in it, so no later replica's ``remove_stale`` would ever take it)."""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "service"))  # tiny.py
from tiny import tiny_char_model  # noqa: E402

from fleet.replica import Replica  # noqa: E402
from trainer_jax.config import load_config  # noqa: E402
from trainer_jax.service import RolloutService  # noqa: E402

TOKEN = "fleet-stop-token"


def test_a_replica_stopped_during_its_fetch_leaves_no_weights(tmp_path, monkeypatch):
    from convert.publish import publish

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "node-tmp"))  # this test's own node
    (tmp_path / "node-tmp").mkdir()
    cfg = load_config(None, ["service.listen=127.0.0.1:0", "groups=[{name: g, spawn: false}]"])
    svc = RolloutService.from_config(cfg, token=TOKEN).start()
    try:
        model = tiny_char_model(tmp_path / "init")
        svc.publish_version(0, publish(model, None, tmp_path / "pub", 0, ["bf16"]))
        r = Replica("g-0", "g", svc.address, TOKEN, ["--group", "g", "--recipe", "bf16"],
                    python=sys.executable, transfer="fetch", fleet="t")
        assert (r.dir / "token").exists()
        r.stop()  # before the fetch finished (here: before it began)
        assert not r.dir.exists()
        r._run()  # the fetch thread's body, run to its end here
        assert r.proc is None  # no sampler started after the stop
        assert not r.dir.exists(), sorted(str(p.relative_to(r.dir)) for p in r.dir.rglob("*"))
    finally:
        svc.stop(grace=0)
