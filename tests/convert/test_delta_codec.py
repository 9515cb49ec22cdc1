"""The delta codec: pieces round-trip for every element size and gap width, corrupt pieces are
refused by name, chains mixing whole files and XOR deltas apply in one pass, old formats are named."""

import io
import json
import struct

import numpy as np
import pytest

from convert.delta import DELTA_NAME, DeltaError, apply_chain, encode_delta, materialize, parse_delta
from convert.delta_codec import encode_piece, xor_piece
from convert.manifest import sha256_file, write_manifest
from convert.safetensors_io import write_file
from convert.store import open_store


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("density", [0.0, 1e-5, 0.04, 1.0])
def test_pieces_round_trip(k, density):
    rng = np.random.default_rng(k)
    n = 70_000 * k  # > 65,536 elements: a sparse piece needs 4-byte gaps
    base = rng.integers(0, 256, n, dtype=np.uint8)
    new = base.copy()
    el = new.view(f"<u{k}")
    hit = rng.random(el.size) < density
    if density == 1e-5:
        hit[[0, el.size - 1]] = True  # one gap spans the whole piece
    el[hit] ^= rng.integers(1, 255, int(hit.sum())).astype(el.dtype)
    buf = base.copy()
    xor_piece(io.BytesIO(encode_piece(new, base, k)), buf, k, "blob")
    assert np.array_equal(buf, new)


def test_a_corrupt_piece_is_refused_by_name():
    base = np.zeros(64, np.uint8)
    new = base.copy()
    new[[3, 60]] = 7
    data = bytearray(encode_piece(new, base, 1))
    data[5 + 1] = 200  # the second gap now points past the piece
    with pytest.raises(DeltaError, match="blob-x: corrupt"):
        xor_piece(io.BytesIO(bytes(data)), base.copy(), 1, "blob-x")
    with pytest.raises(DeltaError, match="blob-x: truncated"):
        xor_piece(io.BytesIO(bytes(data[:8])), base.copy(), 1, "blob-x")
    with pytest.raises(DeltaError, match="corrupt"):
        xor_piece(io.BytesIO(struct.pack("<IB", 65, 1)), base.copy(), 1, "blob-x")


def _export(d, tensors):
    """A one-shard 'export': a safetensors file plus a manifest."""
    d.mkdir(parents=True)
    write_file(d / "model.safetensors", tensors)
    (d / "config.json").write_text("{}")
    write_manifest(d, format="bf16")
    return d


def test_a_chain_mixing_whole_files_and_xor_deltas_applies_in_one_pass(tmp_path):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 32)).astype(np.float32)
    b = a[:32].copy()
    versions = [{"w": a}, {"w": np.where(rng.random(a.shape) < 0.05, a + 1e-3, a).astype(np.float32)},
                {"w": b},  # another layout: stored whole
                {"w": np.where(rng.random(b.shape) < 0.1, b * 1.001, b).astype(np.float32)}]
    full = [_export(tmp_path / f"full{v}", t) for v, t in enumerate(versions)]
    root = tmp_path / "root"
    (root / "v00000000").mkdir(parents=True)
    (root / "v00000000" / "bf16").symlink_to(full[0])
    for v in range(1, 4):
        encode_delta(full[v], full[v - 1], root / f"v{v:08d}" / "bf16", version=v, base_version=v - 1)
    metas = [json.loads((root / f"v{v:08d}" / "bf16" / DELTA_NAME).read_text()) for v in range(1, 4)]
    ops = [m["files"]["model.safetensors"]["op"] for m in metas]
    assert ops == ["xor", "full", "xor"]
    digests = apply_chain([root / f"v{v:08d}" / "bf16" for v in range(1, 4)], full[0], tmp_path / "out")
    want = full[3] / "model.safetensors"
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == want.read_bytes()
    assert digests["model.safetensors"] == (want.stat().st_size, sha256_file(want))
    assert not list((tmp_path / "out").glob("*.base"))  # the whole file's temp copy is gone
    how = materialize(open_store(root), 3, "bf16", tmp_path / "m", have=(0, full[0]))
    assert how == "v0 held + 3 delta(s)"


def test_an_announced_manifest_that_disagrees_is_refused(tmp_path):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((16, 16)).astype(np.float32)
    v0 = _export(tmp_path / "v0", {"w": a})
    v1 = _export(tmp_path / "v1", {"w": (a * 1.001).astype(np.float32)})
    root = tmp_path / "root"
    (root / "v00000000").mkdir(parents=True)
    (root / "v00000000" / "bf16").symlink_to(v0)
    encode_delta(v1, v0, root / "v00000001" / "bf16", version=1, base_version=0)
    size = (v1 / "model.safetensors").stat().st_size
    with pytest.raises(DeltaError, match="does not match the announced manifest"):
        materialize(open_store(root), 1, "bf16", tmp_path / "out",
                    expect={"model.safetensors": (size, "0" * 64)})
    assert not (tmp_path / "out").exists()
    right = {"model.safetensors": (size, sha256_file(v1 / "model.safetensors"))}
    assert materialize(open_store(root), 1, "bf16", tmp_path / "out", expect=right)


def test_an_old_delta_format_is_named_in_one_line():
    with pytest.raises(DeltaError) as e:
        parse_delta(json.dumps({"delta_version": 1, "base": 0}), "ROOT/v00000001/bf16")
    assert "delta_version 1" in str(e.value) and "full snapshot" in str(e.value)
    assert "\n" not in str(e.value)
