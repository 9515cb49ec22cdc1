"""Weight fetch on a foreign publish root and a corrupted cache (issue 46): what a sampler loads
must be what the trainer announced, byte for byte, whatever the store or its own cache hold.

Real files: two publish roots of the tiny model (``convert.publish``, deltas on), the service's
own ``WeightRegistry`` announcing versions, ``materialize_weights`` reading a store or copying
files through a ``fetch_file`` that checks like the client does.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from weight_versions import CFG, assert_same_export, versions_of_weights

from convert.delta import DELTA_NAME
from convert.manifest import sha256_file
from convert.publish import publish
from mixrl_wire import pb
from sampler_torch.weights_fetch import WeightsError, check_downloaded, materialize_weights
from trainer_jax.service.weights import WeightRegistry


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    """``ours``: v0 (full) and v1 (a delta); ``foreign``: another run's v0 and v1, same numbers,
    other weights (a restarted trainer, or a root another run shares); ``full``: ours in full."""
    base = tmp_path_factory.mktemp("roots")
    for name, seed in (("ours", 3), ("foreign", 4)):
        for v, params in enumerate(versions_of_weights(2, seed=seed)):
            publish(params, CFG, base / name, v, ["bf16"], keep_last=None, delta=True, full_every=5)
            if name == "ours":
                publish(params, CFG, base / "full", v, ["bf16"], keep_last=None)
    assert (base / "ours" / "v00000001" / "bf16" / DELTA_NAME).is_file()
    return base


def _announced(root: Path, version: int) -> pb.WeightVersion:
    reg = WeightRegistry()
    for v in range(version + 1):
        reg.publish(v, {"bf16": root / f"v{v:08d}" / "bf16"})
    return reg.latest.to_pb()


def _never(*a, **kw):
    raise AssertionError("nothing is fetched over the session here")


def test_a_delta_from_a_foreign_root_is_refused(roots, tmp_path):
    """Issue 46: the store a location names is read, but what it builds must match the files the
    trainer announced: a chain applied without that list loaded the other run's weights."""
    wv = _announced(roots / "ours", 1)
    loc = wv.locations[0]
    assert loc.store and Path(loc.store).resolve() == (roots / "ours").resolve()
    fmt, path = materialize_weights(wv, tmp_path / "ok", formats=["bf16"], fetch_file=_never, cache_key="k")
    assert_same_export(path, roots / "full" / "v00000001" / "bf16")
    loc.store = str(roots / "foreign")  # the same version numbers, another run's weights
    with pytest.raises(WeightsError, match=r"^version 1 format bf16: "):
        materialize_weights(wv, tmp_path / "c", formats=["bf16"], fetch_file=_never, cache_key="k")
    assert not list((tmp_path / "c").glob("*/bf16"))  # nothing left looking finished
    # held weights do not help a foreign chain either
    held = {"bf16": (0, roots / "full" / "v00000000" / "bf16")}
    with pytest.raises(WeightsError):
        materialize_weights(wv, tmp_path / "d", formats=["bf16"], fetch_file=_never, cache_key="k", held=held)


class _Files:
    """A ``FetchFile`` copying from a directory, checked as the client checks a download."""

    def __init__(self, src: Path):
        self.src, self.count = src, 0

    def __call__(self, version, fmt, rel, dest, size, sha256, *, have_version=None):
        self.count += 1
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.src / rel, dest)
        check_downloaded(dest, rel, version, fmt, size, sha256)


def test_a_corrupted_cached_version_is_fetched_again_not_loaded(roots, tmp_path):
    """Issue 46: a cached version reused without verification loaded a corrupted shard."""
    src = roots / "full" / "v00000001" / "bf16"
    files = [pb.FileDigest(path=p.name, size=p.stat().st_size, sha256=sha256_file(p))
             for p in sorted(src.iterdir()) if p.is_file()]
    wv = pb.WeightVersion(version=1, locations=[pb.WeightLocation(
        format="bf16", path="/nonexistent/trainer/dir", manifest=pb.Manifest(files=files))])
    fetch = _Files(src)
    _, path = materialize_weights(wv, tmp_path, formats=["bf16"], fetch_file=fetch, cache_key="k",
                                  transfer="fetch")
    first = fetch.count
    assert first == len(files)
    shard = next(path.glob("*.safetensors"))
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # same size: only the digest tells
    shard.write_bytes(bytes(raw))
    _, again = materialize_weights(wv, tmp_path, formats=["bf16"], fetch_file=fetch, cache_key="k",
                                   transfer="fetch")
    assert fetch.count > first  # fetched again
    assert_same_export(again, src)
    # a cached file missing altogether: fetched again too
    (again / "config.json").unlink()
    _, third = materialize_weights(wv, tmp_path, formats=["bf16"], fetch_file=fetch, cache_key="k",
                                   transfer="fetch")
    assert_same_export(third, src)


def test_a_version_in_no_format_this_sampler_takes_names_every_format_sorted(tmp_path):
    locs = [pb.WeightLocation(format=f, path="/nonexistent", manifest=pb.Manifest(files=[
        pb.FileDigest(path="config.json", size=2, sha256="00")])) for f in ("nvfp4", "bf16", "fp8")]
    with pytest.raises(WeightsError, match=r"^version 3 offers formats \['bf16', 'fp8', 'nvfp4'\], "
                                           r"this sampler takes \['mxfp4'\]$"):
        materialize_weights(pb.WeightVersion(version=3, locations=locs), tmp_path, formats=["mxfp4"],
                            fetch_file=_never, cache_key="k")


@pytest.mark.parametrize("transfer", ["auto", "fetch"])
def test_a_version_announced_with_an_empty_manifest_is_refused_not_loaded(roots, tmp_path, transfer):
    """An announcement whose manifest lists no file verifies nothing: loading the directory it
    names (readable here) or an empty fetched one would serve unverified weights. Refused, with
    nothing fetched and nothing left in the cache looking finished."""
    src = roots / "full" / "v00000001" / "bf16"
    wv = pb.WeightVersion(version=1, locations=[pb.WeightLocation(
        format="bf16", path=str(src), manifest=pb.Manifest(files=[]))])
    with pytest.raises(WeightsError, match=r"^version 1 format bf16: empty manifest$"):
        materialize_weights(wv, tmp_path, formats=["bf16"], fetch_file=_never, cache_key="k",
                            transfer=transfer)
    assert not list(tmp_path.glob("*/bf16"))
