"""An unchained weight location fetched over real gRPC (issue 37). A ``WeightLocation`` without a
``chain`` is valid on the wire and takes ``weights_fetch``'s plain download path, where the only
check is ``check_downloaded``'s: with its sha256 comparison dropped, a corrupt file of the right
size was accepted and no test noticed (the chained path verifies a second time in ``materialize``)."""

from __future__ import annotations

import pytest

from sampler_torch.client import Backoff, RolloutClient, WeightsError
from sampler_torch.weights_fetch import check_downloaded
from trainer_jax.config import load_config
from trainer_jax.service import RolloutService

TOKEN = "s3cret-token"
BASE = ["service.listen=127.0.0.1:0", "tasks.group_size=2", "tasks.sampling.max_new_tokens=8",
        "tasks.sampling.head_k=4"]


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """Version 1 of the tiny model as published; version 2 the same with one shard's byte flipped."""
    from tiny import tiny_char_model

    from convert.publish import publish
    root = tmp_path_factory.mktemp("weights")
    init = tiny_char_model(root / "init")
    v1 = publish(init, None, root / "pub", 1, ["bf16"], keep_last=None)
    v2 = publish(init, None, root / "pub", 2, ["bf16"], keep_last=None)
    shard = next(v2["bf16"].glob("*.safetensors"))
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0xFF  # same size, different bytes: only the sha256 can tell
    shard.write_bytes(bytes(raw))
    return v1, v2


def _unchained(wv):
    for loc in wv.locations:
        del loc.chain[:]
        loc.store = ""
    return wv


def test_an_unchained_location_with_a_corrupt_file_is_refused(published, tmp_path):
    v1, v2 = published
    svc = RolloutService.from_config(load_config(None, BASE), token=TOKEN).start()
    try:
        c = RolloutClient(svc.address, TOKEN, group="g", name="g-0", capacity=8, max_retry_s=3.0,
                          backoff=Backoff(initial_s=0.01, max_s=0.1))
        c.register()
        svc.publish_version(1, v1)
        wv = _unchained(next(c.watch_weights(after_version=0)))
        assert not wv.locations[0].chain
        fmt, path = c.materialize_weights(wv, tmp_path / "cache", transfer="fetch")
        assert fmt == "bf16" and path.is_relative_to(tmp_path / "cache")
        assert sorted(p.name for p in path.iterdir()) == sorted(p.name for p in v1["bf16"].iterdir())
        for f in v1["bf16"].iterdir():
            assert (path / f.name).read_bytes() == f.read_bytes()
        svc.publish_version(2, v2)
        wv2 = _unchained(next(c.watch_weights(after_version=1)))
        with pytest.raises(WeightsError, match="sha256 does not match the manifest"):
            c.materialize_weights(wv2, tmp_path / "cache", transfer="fetch")
        # nothing of version 2 is left looking finished, nor as a partial download
        assert not list((tmp_path / "cache").glob("*-v00000002/bf16"))
        assert not [p for p in (tmp_path / "cache").rglob("*.safetensors") if "v00000002" in str(p)]
    finally:
        svc.stop(grace=0)


def test_check_downloaded_names_the_problem_and_deletes_the_file(tmp_path):
    dest = tmp_path / "shard.bin"
    dest.write_bytes(b"abcd")
    sha = "88d4266fd4e6338d13b845fcf289579d209c897823b9217da3e161936f031589"  # sha256(b"abcd")
    check_downloaded(dest, "shard.bin", 3, "bf16", 4, sha)  # matches: kept
    assert dest.exists()
    with pytest.raises(WeightsError, match=r"^shard.bin of version 3 \(bf16\): size 4, the manifest says 5$"):
        check_downloaded(dest, "shard.bin", 3, "bf16", 5, sha)
    assert not dest.exists()
    dest.write_bytes(b"abce")
    with pytest.raises(WeightsError, match="sha256 does not match the manifest"):
        check_downloaded(dest, "shard.bin", 3, "bf16", 4, sha)
    assert not dest.exists()
