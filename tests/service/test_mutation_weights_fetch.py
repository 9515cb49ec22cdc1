"""An unchained weight location fetched over real gRPC (issue 37). A ``WeightLocation`` without a
``chain`` is valid on the wire and takes ``weights_fetch``'s plain download path, where the only
check is ``check_downloaded``'s: with its sha256 comparison dropped, a corrupt file of the right
size was accepted and no test noticed (the chained path verifies a second time in ``materialize``)."""

from __future__ import annotations

import shutil

import pytest

from convert.delta import DeltaError
from convert.manifest import sha256_file
from mixrl_wire import pb
from sampler_torch.client import Backoff, RolloutClient, WeightsError
from sampler_torch.weights_fetch import _FetchedChain, check_downloaded, materialize_weights
from trainer_jax.config import load_config
from trainer_jax.service import RolloutService

TOKEN = "s3cret-token"
BASE = ["service.listen=127.0.0.1:0", "tasks.group_size=2", "tasks.sampling.max_new_tokens=8",
        "tasks.sampling.head_k=4"]


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


# --- weights_fetch on its own: a directory served by copying files (the transfer is the session's,
# tested above over gRPC), so each path is reached on purpose


def _wv(version: int, src, *, path: str = "/nonexistent/trainer/dir", chain=()) -> pb.WeightVersion:
    files = [pb.FileDigest(path=p.name, size=p.stat().st_size, sha256=sha256_file(p))
             for p in sorted(src.iterdir()) if p.is_file()]
    return pb.WeightVersion(version=version, locations=[pb.WeightLocation(
        format="bf16", path=path, manifest=pb.Manifest(files=files), chain=list(chain))])


class _Copier:
    """A ``FetchFile`` reading from a directory: counts its calls, checks like the client does."""

    def __init__(self, src):
        self.src, self.calls = src, []

    def __call__(self, version, fmt, rel, dest, size, sha256, *, have_version=None):
        self.calls.append((version, rel, have_version))
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.src / rel, dest)
        check_downloaded(dest, rel, version, fmt, size, sha256)


@pytest.fixture
def plain_dir(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text('{"layers": 1}')
    (src / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    return src


def test_a_plain_fetch_is_reused_once_verified_and_retried_after_a_failure(plain_dir, tmp_path):
    cache, copier = tmp_path / "cache", _Copier(plain_dir)
    wv = _wv(4, plain_dir)
    shard = plain_dir / "model.safetensors"
    good = shard.read_bytes()
    shard.write_bytes(good[:-1] + b"\x00")  # served corrupt: refused, nothing left looking finished
    with pytest.raises(WeightsError, match="model.safetensors of version 4 \\(bf16\\): sha256"):
        materialize_weights(wv, cache, formats=["bf16"], fetch_file=copier, cache_key="k", transfer="fetch")
    assert not (cache / "k-v00000004" / "bf16").exists()
    shard.write_bytes(good)  # the retry (the version's directory exists from the failed try)
    fmt, path = materialize_weights(wv, cache, formats=["fp8", "bf16"], fetch_file=copier, cache_key="k",
                                    transfer="fetch")
    assert (fmt, path) == ("bf16", cache / "k-v00000004" / "bf16")
    assert (path / "model.safetensors").read_bytes() == good
    copier.calls.clear()
    assert materialize_weights(wv, cache, formats=["bf16"], fetch_file=copier, cache_key="k",
                               transfer="fetch") == ("bf16", path)
    assert copier.calls == []  # verified in the cache: not downloaded again


def test_a_shared_directory_is_verified_in_place(plain_dir, tmp_path):
    wv = _wv(2, plain_dir, path=str(plain_dir))
    copier = _Copier(plain_dir)
    assert materialize_weights(wv, tmp_path / "c", formats=["bf16"], fetch_file=copier,
                               cache_key="k") == ("bf16", plain_dir)
    (plain_dir / "config.json").write_text('{"layers": 2}')
    with pytest.raises(WeightsError, match=r"^version 2 format bf16: .*config.json: sha256 does not match"):
        materialize_weights(wv, tmp_path / "c", formats=["bf16"], fetch_file=copier, cache_key="k")
    assert copier.calls == []
    # "shared" read from a config is not the interned literal: still compared by value
    shared = "".join(["sha", "red"])
    with pytest.raises(WeightsError, match="is not readable here"):
        materialize_weights(_wv(2, plain_dir), tmp_path / "c", formats=["bf16"], fetch_file=copier,
                            cache_key="k", transfer=shared)
    with pytest.raises(WeightsError, match=r"offers formats \['bf16'\], this sampler takes \['fp8'\]"):
        materialize_weights(wv, tmp_path / "c", formats=["fp8"], fetch_file=copier, cache_key="k")


def _chain_location(steps, stored_path="delta.json") -> pb.WeightLocation:
    stored = pb.Manifest(files=[pb.FileDigest(path=stored_path, size=1, sha256="00")])
    return pb.WeightLocation(format="bf16", chain=[pb.WeightStep(version=v, base=b, stored=stored)
                                                   for v, b in steps])


def test_a_fetched_chain_stops_at_the_held_version_else_at_the_full_snapshot(tmp_path):
    loc = _chain_location([(1, -1), (2, 1), (3, 2)])
    assert _FetchedChain(loc, _Copier(tmp_path), 2).chain(3, "bf16", 2) == (2, [3])
    assert _FetchedChain(loc, _Copier(tmp_path), None).chain(3, "bf16", None) == (1, [2, 3])
    assert _FetchedChain(loc, _Copier(tmp_path), 0).chain(3, "bf16", 0) == (1, [2, 3])  # 0 not served
    with pytest.raises(DeltaError, match="no longer serves version 4 of bf16"):
        _FetchedChain(_chain_location([(5, 4)]), _Copier(tmp_path), None).chain(5, "bf16", None)


def test_a_fetched_chain_refuses_a_stored_path_that_escapes(tmp_path):
    copier = _Copier(tmp_path)
    source = _FetchedChain(_chain_location([(3, -1)], stored_path="../outside"), copier, None)
    with pytest.raises(WeightsError, match="manifest path '../outside' escapes the weights directory"):
        source.local_dir(3, "bf16", tmp_path / "work")
    assert copier.calls == []
