"""Samplers following delta versions through the real service on loopback: catching up from what
they hold, late joiners, corrupt deltas refused while the old weights keep serving."""

import shutil

import grpc
import pytest
from test_service import FAST, TOKEN, make_service, raw_stub
from weight_versions import CFG, assert_same_export, versions_of_weights

from convert.delta import DELTA_NAME
from convert.publish import publish
from mixrl_wire import pb
from sampler_torch.client import RolloutClient, WeightsError

FORMATS = ["bf16", "nvfp4"]


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """v0..v5 as deltas (a full snapshot every 5 versions: v0 and v5) and, separately, in full."""
    base = tmp_path_factory.mktemp("pub")
    for v, params in enumerate(versions_of_weights(6, seed=7)):
        publish(params, CFG, base / "delta", v, FORMATS, keep_last=None, delta=True, full_every=5)
        publish(params, CFG, base / "full", v, FORMATS, keep_last=None)
    assert (base / "delta" / "v00000004" / "nvfp4" / DELTA_NAME).is_file()
    assert not (base / "delta" / "v00000005" / "nvfp4" / DELTA_NAME).exists()
    return base


class RecordingClient(RolloutClient):
    """The real client, noting every file it downloads."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.fetched: list[tuple[int, str, int | None]] = []

    def fetch_file(self, version, fmt, rel, dest, size, sha256, *, have_version=None):
        self.fetched.append((version, rel, have_version))
        super().fetch_file(version, fmt, rel, dest, size, sha256, have_version=have_version)


@pytest.fixture
def svc():
    service = make_service()
    yield service
    service.stop(grace=0)


def sampler(svc) -> RecordingClient:
    c = RecordingClient(svc.address, TOKEN, group="g", backoff=FAST, capacity=1, max_retry_s=3.0,
                        weight_formats=("nvfp4",))
    c.register()
    return c


def announce(svc, root, v):
    svc.publish_version(v, {f: root / f"v{v:08d}" / f for f in FORMATS})
    return svc.weights.latest.to_pb()


def test_a_sampler_that_missed_versions_catches_up_with_deltas_over_grpc(svc, published, tmp_path):
    root, c = published / "delta", sampler(svc)
    fmt, p0 = c.materialize_weights(announce(svc, root, 0), tmp_path / "cache", transfer="fetch")
    assert all(h == -1 for _, _, h in c.fetched)  # nothing held: the full snapshot's files
    for v in (1, 2):
        announce(svc, root, v)  # published while this sampler was busy: never materialized
    c.fetched.clear()
    fmt, p3 = c.materialize_weights(announce(svc, root, 3), tmp_path / "cache", transfer="fetch")
    assert fmt == "nvfp4" and p3.is_relative_to(tmp_path / "cache")
    assert {v for v, _, _ in c.fetched} == {1, 2, 3} and {h for _, _, h in c.fetched} == {0}
    assert all(rel == DELTA_NAME or rel.startswith("blobs/") for _, rel, _ in c.fetched)
    assert_same_export(p3, published / "full" / "v00000003" / "nvfp4")
    assert not p0.exists() or p0.parent.name.endswith("v00000000")  # at most the previous one kept

    late = sampler(svc)  # joins now: the newest full snapshot, then the deltas since
    fmt, p = late.materialize_weights(svc.weights.latest.to_pb(), tmp_path / "late", transfer="fetch")
    assert sorted({v for v, _, _ in late.fetched}) == [0, 1, 2, 3]
    assert_same_export(p, published / "full" / "v00000003" / "nvfp4")


def test_shared_store_is_read_directly_and_delta_files_are_not_served_as_full_ones(svc, published,
                                                                                    tmp_path):
    root, c = published / "delta", sampler(svc)
    c.materialize_weights(announce(svc, root, 0), tmp_path / "cache")
    wv = announce(svc, root, 1)
    assert wv.locations[1].store == str(root.resolve())
    fmt, p = c.materialize_weights(wv, tmp_path / "cache")  # auto: the store is readable here
    assert not c.fetched
    assert_same_export(p, published / "full" / "v00000001" / "nvfp4")
    stub, md = raw_stub(svc)
    with pytest.raises(grpc.RpcError) as info:  # an old sampler asking for a full file of a delta
        list(stub.FetchWeights(pb.FetchWeightsRequest(session_id=c.session_id, version=1, format="nvfp4",
                                                      path="config.json"), metadata=md))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "stored as a delta" in info.value.details()


@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_a_bad_delta_is_refused_the_old_weights_serve_and_the_next_snapshot_recovers(
        svc, published, tmp_path, damage):
    root = shutil.copytree(published / "delta", tmp_path / "root")
    c = sampler(svc)
    for v in range(4):
        fmt, held = c.materialize_weights(announce(svc, root, v), tmp_path / "cache", transfer="fetch")
    before = {f.name: f.read_bytes() for f in held.iterdir()}
    blob = max((root / "v00000004" / "nvfp4" / "blobs").iterdir(), key=lambda f: f.stat().st_size)
    data = blob.read_bytes()
    blob.write_bytes(data[:-7] if damage == "truncate" else data[:-7] + bytes(7))
    with pytest.raises(WeightsError, match="version 4"):
        c.materialize_weights(announce(svc, root, 4), tmp_path / "cache", transfer="fetch")
    assert {f.name: f.read_bytes() for f in held.iterdir()} == before  # v3 still whole, still served
    fmt, p5 = c.materialize_weights(announce(svc, root, 5), tmp_path / "cache", transfer="fetch")
    assert_same_export(p5, published / "full" / "v00000005" / "nvfp4")
