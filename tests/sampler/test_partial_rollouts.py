"""Partial rollouts on the engine (issue 34): with ``partial_rollouts`` on, a reload staged during
a long generate is applied at the next step boundary (the request's tokens carry two versions);
with it off, the request finishes on the old weights and the reload is applied when the call
returns, so the next call (the next turn of an episode) runs on the new version."""

import threading

import pytest
from tiny_models import build_hf_model

from convert.export import export_hf
from convert.hf_checkpoint import HFCheckpoint
from sampler_torch.engine import Engine, SamplingParams


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("partial")
    dirs = {}
    for version in (0, 1):
        build_hf_model("dense_tied_gqa2", seed=version).save_pretrained(root / f"src{version}")
        ckpt = HFCheckpoint(root / f"src{version}")
        dirs[version] = export_hf(ckpt.tensors(), ckpt.config, root / f"v{version}", "bf16",
                                  engines="mixrl")
    return dirs


@pytest.mark.parametrize("partial", [True, False])
def test_a_reload_during_a_long_generate(exports, partial):
    eng = Engine(exports[0], "bf16", compute_dtype="float32", max_batch=2, version=0)
    assert eng.partial_rollouts is True  # the default: the engine as it always was
    eng.set_partial_rollouts(partial)
    params = SamplingParams(max_new_tokens=12, seed=0)

    def on_step(step):
        if step == 4:
            eng.load_weights(exports[1], 1)
            assert eng.version == 0  # staged, not applied inside the step

    first = eng.generate([[1, 2, 3], [4, 5]], params, on_step=on_step)
    if partial:
        assert eng.last_stats.swaps == [(5, 1)]
        assert all(c.versions == [0] * 5 + [1] * 7 for c in first)
    else:
        assert eng.last_stats.swaps == []
        assert all(c.versions == [0] * 12 for c in first)
    assert eng.version == 1  # applied by the time the call returns, either way
    # The next turn of an episode (its context so far as the prompt) runs on the new weights.
    turn2 = eng.generate([[1, 2, 3, *first[0].token_ids]], SamplingParams(max_new_tokens=3))
    assert turn2[0].versions == [1, 1, 1]


def test_without_partial_rollouts_a_reload_from_another_thread_waits_for_the_call(exports):
    """The sampler loop's weights thread loads while the main thread generates."""
    eng = Engine(exports[0], "bf16", compute_dtype="float32", max_batch=1, version=0)
    eng.set_partial_rollouts(False)
    started, loaded = threading.Event(), threading.Event()

    def on_step(step):
        if step == 2:
            started.set()
            assert loaded.wait(60)  # the load returns (staged) while this request still runs

    def load():
        assert started.wait(60)
        eng.load_weights(exports[1], 1)
        loaded.set()

    t = threading.Thread(target=load)
    t.start()
    out = eng.generate([[7, 8]], SamplingParams(max_new_tokens=10, seed=1), on_step=on_step)[0]
    t.join()
    assert out.versions == [0] * 10 and eng.version == 1


@pytest.mark.parametrize("setting", [True, False])
def test_train_partial_rollouts_reaches_the_backend_through_registration(exports, setting, caplog):
    """train.partial_rollouts -> RegisterResponse (real gRPC) -> SamplerLoop -> the backend."""
    from sampler_torch.client import Backoff, RolloutClient
    from sampler_torch.loop import SamplerLoop
    from trainer_jax.config import load_config
    from trainer_jax.service import RolloutService

    cfg = load_config(None, ["service.listen=127.0.0.1:0", f"train.partial_rollouts={setting}"])
    assert cfg.train.partial_rollouts is setting
    svc = RolloutService.from_config(cfg, token="pr-token").start()
    client = RolloutClient(svc.address, "pr-token", group="g", capacity=2, name="pr",
                           backoff=Backoff(initial_s=0.01, max_s=0.1), max_retry_s=3.0)
    try:
        info = client.register()
        assert info.HasField("partial_rollouts") and info.partial_rollouts is setting
        eng = Engine(exports[0], "bf16", compute_dtype="float32", max_batch=1)
        eng.set_partial_rollouts(not setting)
        SamplerLoop(client, eng).follow_registration(info)
        assert eng.partial_rollouts is setting

        class Hookless:  # a backend that cannot honour the setting is told so in the log
            version = 0

        with caplog.at_level("WARNING", logger="mixrl.sampler"):
            SamplerLoop(client, Hookless()).follow_registration(info)
        assert f"partial_rollouts={setting} but backend Hookless has no set_partial_rollouts" \
            in caplog.text
    finally:
        client.close()
        svc.stop(grace=0)


def test_a_registration_without_the_field_leaves_the_backend_default(exports):
    from mixrl_wire import pb
    from sampler_torch.loop import SamplerLoop

    eng = Engine(exports[0], "bf16", compute_dtype="float32", max_batch=1)
    SamplerLoop(None, eng).follow_registration(pb.RegisterResponse(session_id="s"))  # older trainer
    assert eng.partial_rollouts is True
