"""The external-sampler example in docs/wire.md runs as written against a live service."""

import re
import threading
import time
from pathlib import Path

import numpy as np
from fakes import fake_records

from trainer_jax.config import load_config
from trainer_jax.service import RolloutService

DOC = Path(__file__).resolve().parents[2] / "docs" / "wire.md"


def test_external_sampler_example(tmp_path, monkeypatch):
    from tiny import tiny_char_model

    from convert.publish import publish
    block = re.search(r"### An external sampler joining.*?```python\n(.*?)```", DOC.read_text(),
                      re.S).group(1)
    svc = RolloutService.from_config(load_config(None, [
        "service.listen=127.0.0.1:0", "tasks.group_size=2", "tasks.sampling.top_p=0.9",
        "tasks.sampling.top_k=32", "tasks.sampling.head_k=5", "tasks.sampling.max_new_tokens=6"]),
        token="doc-token").start()
    monkeypatch.setenv("MIXRL_TRAINER", svc.address)
    monkeypatch.setenv("MIXRL_TOKEN", "doc-token")
    loaded = []
    rng = np.random.default_rng(0)

    def my_generate(prompt_ids, sampling, seed):
        rec = fake_records(4, svc.vocab_size, sampling.head_k, rng, top_p=sampling.top_p,
                           top_k=sampling.top_k, version=ns.get("version", 0))
        return {**rec, "finish_reason": "length"}

    ns = {"my_generate": my_generate, "load_weights": lambda path, v: loaded.append((path, v))}
    runner = threading.Thread(target=exec, args=(block, ns), daemon=True)
    runner.start()
    try:
        deadline = time.monotonic() + 30
        while svc.status()["totals"].get("accepted", 0) < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        v1 = publish(tiny_char_model(tmp_path / "m"), None, tmp_path / "pub", 1, ["fp8_block"])
        svc.publish_version(1, v1)
        while not loaded and time.monotonic() < deadline:
            time.sleep(0.05)
        ns["running"] = False
        runner.join(timeout=10)
    finally:
        ns["client"].close()
        svc.stop(grace=0)
    assert loaded == [(v1["fp8_block"].resolve(), 1)]
    st = svc.status()
    assert st["totals"]["accepted"] >= 20 and st["totals"].get("rejected", 0) == 0
    assert st["groups"]["h100-sglang-fp8"]["accepted"] >= 20
