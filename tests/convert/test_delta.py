"""Delta versions: chains materialize byte-identical to full publishes, fallbacks, pruning."""

import shutil

import pytest
from weight_versions import CFG, FORMATS, assert_same_export, versions_of_weights

from convert.cli import main
from convert.delta import DELTA_NAME, DeltaError, materialize
from convert.publish import LATEST, list_versions, publish
from convert.store import open_store


@pytest.fixture(scope="module")
def chain5(tmp_path_factory):
    """Five versions in every format, published as deltas and, separately, in full."""
    base = tmp_path_factory.mktemp("chain")
    reports = []
    for v, params in enumerate(versions_of_weights(5)):
        report: dict = {}
        publish(params, CFG, base / "delta", v, FORMATS, keep_last=None, delta=True, report=report)
        publish(params, CFG, base / "full", v, FORMATS, keep_last=None)
        reports.append(report)
    return base, reports


@pytest.mark.parametrize("fmt", FORMATS)
def test_chain_of_five_materializes_byte_identical_to_full_publishes(chain5, tmp_path, fmt):
    base, reports = chain5
    store = open_store(base / "delta")
    for v in range(5):
        is_delta = (base / "delta" / f"v{v:08d}" / fmt / DELTA_NAME).is_file()
        assert is_delta == (v > 0)
        assert reports[v][fmt]["delta_base"] == (v - 1 if v else None)
        if v:
            assert reports[v][fmt]["bytes"] < reports[v][fmt]["full_bytes"]
        how = materialize(store, v, fmt, tmp_path / f"v{v}")
        assert how == f"full snapshot v0 + {v} delta(s)"  # a late joiner: from the snapshot
        assert_same_export(tmp_path / f"v{v}", base / "full" / f"v{v:08d}" / fmt)


def test_a_sampler_that_missed_versions_catches_up_from_what_it_holds(chain5, tmp_path):
    base, _ = chain5
    store = open_store(base / "delta")
    held = base / "full" / "v00000001" / "nvfp4"  # what the sampler loaded two versions ago
    how = materialize(store, 4, "nvfp4", tmp_path / "v4", have=(1, held))
    assert how == "v1 held + 3 delta(s)"
    assert_same_export(tmp_path / "v4", base / "full" / "v00000004" / "nvfp4")


def test_a_corrupt_held_copy_falls_back_to_the_full_snapshot(chain5, tmp_path):
    base, _ = chain5
    held = shutil.copytree(base / "full" / "v00000002" / "bf16", tmp_path / "held")
    shard = next(held.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x40
    shard.write_bytes(bytes(data))
    messages = []
    how = materialize(open_store(base / "delta"), 4, "bf16", tmp_path / "v4", have=(2, held),
                      log=messages.append)
    assert how == "full snapshot v0 + 4 delta(s)"
    assert "falling back" in messages[0] and "sha256" in messages[0]
    assert_same_export(tmp_path / "v4", base / "full" / "v00000004" / "bf16")


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_corrupt_or_truncated_delta_is_refused_and_nothing_appears(chain5, tmp_path, damage):
    base, _ = chain5
    root = shutil.copytree(base / "delta", tmp_path / "root")
    blob = max((root / "v00000003" / "fp8_block" / "blobs").iterdir(), key=lambda p: p.stat().st_size)
    data = blob.read_bytes()
    blob.write_bytes(data[: len(data) // 2] if damage == "truncate"
                     else data[:40] + bytes([data[40] ^ 0xFF]) + data[41:])
    held = base / "full" / "v00000002" / "fp8_block"
    before = {p.name: p.read_bytes() for p in held.iterdir()}
    with pytest.raises(DeltaError, match="corrupt|truncated|sha256"):
        materialize(open_store(root), 4, "fp8_block", tmp_path / "v4", have=(2, held))
    assert not (tmp_path / "v4").exists()
    assert {p.name: p.read_bytes() for p in held.iterdir()} == before  # old weights untouched
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".v4.")]  # no temp left


def test_a_gap_in_the_chain_is_named(chain5, tmp_path):
    base, _ = chain5
    root = shutil.copytree(base / "delta", tmp_path / "root")
    shutil.rmtree(root / "v00000002")
    with pytest.raises(DeltaError, match="version 2 has no bf16 weights"):
        materialize(open_store(root), 4, "bf16", tmp_path / "v4")


def test_full_snapshot_every_n_versions_and_pruning_keeps_needed_bases(tmp_path):
    root = tmp_path / "w"
    for v, params in enumerate(versions_of_weights(6, seed=1)):
        publish(params, CFG, root, v, ["bf16", "nvfp4"], keep_last=2, delta=True, full_every=3)
        # keep_last=2, but every kept delta's bases back to its full snapshot stay
        kept = list_versions(root)
        for k in kept:
            for fmt in ("bf16", "nvfp4"):
                materialize(open_store(root), k, fmt, tmp_path / "m" / f"{k}-{fmt}")
    assert [(root / f"v{v:08d}" / "bf16" / DELTA_NAME).is_file() for v in (3, 4, 5)] == [False, True, True]
    assert list_versions(root) == [3, 4, 5]  # v0..v2 went once v3 (a full snapshot) was the base
    assert (root / LATEST).read_text() == "v00000005\n"


def test_base_missing_from_the_cache_is_materialized_from_the_store(tmp_path):
    params = versions_of_weights(3, seed=2)
    root = tmp_path / "w"
    publish(params[0], CFG, root, 0, ["mxfp4"], delta=True)
    publish(params[1], CFG, root, 1, ["mxfp4"], delta=True)
    shutil.rmtree(root / ".publish-cache")  # a restarted trainer
    publish(params[2], CFG, root, 2, ["mxfp4"], delta=True)
    assert (root / "v00000002" / "mxfp4" / DELTA_NAME).is_file()
    publish(params[2], CFG, tmp_path / "full", 2, ["mxfp4"])
    materialize(open_store(root), 2, "mxfp4", tmp_path / "m")
    assert_same_export(tmp_path / "m", tmp_path / "full" / "v00000002" / "mxfp4")


def test_a_lower_version_than_existing_ones_is_kept_and_named_by_latest(tmp_path):
    """A resumed run publishes a lower number than versions its predecessor left: pruning must
    not delete what was just published, and LATEST must name a directory that exists."""
    params = versions_of_weights(1)[0]
    root = tmp_path / "w"
    for v in (250, 300, 310):
        publish(params, CFG, root, v, ["bf16"], keep_last=2)
    publish(params, CFG, root, 241, ["bf16"], keep_last=2, delta=True)
    assert 241 in list_versions(root)
    latest = (root / LATEST).read_text().strip()
    assert latest == "v00000241" and (root / latest / "bf16").is_dir()


def test_cli_publish_delta_and_materialize(tmp_path, capsys):
    params = versions_of_weights(2, seed=3)
    srcs = []
    for i, p in enumerate(params):  # weights trained elsewhere, handed over as HF directories
        publish(p, CFG, tmp_path / f"src{i}", 0, ["bf16"])
        srcs.append(tmp_path / f"src{i}" / "v00000000" / "bf16")
    root = tmp_path / "fleet"
    for v, src in enumerate(srcs):
        assert main(["publish", "--in", str(src), "--root", str(root), "--version", str(v),
                     "--format", "bf16", "--format", "nvfp4", "--delta", "--quiet"]) == 0
    out = capsys.readouterr().err
    assert "delta against v0" in out and "bytes" in out
    assert (root / "v00000001" / "nvfp4" / DELTA_NAME).is_file()
    assert main(["materialize", "--root", str(root), "--version", "1", "--format", "nvfp4",
                 "--out", str(tmp_path / "m")]) == 0
    main(["publish", "--in", str(srcs[1]), "--root", str(tmp_path / "full"), "--version", "1",
          "--format", "nvfp4", "--quiet"])
    assert_same_export(tmp_path / "m", tmp_path / "full" / "v00000001" / "nvfp4")
    assert main(["materialize", "--root", str(root), "--version", "7", "--format", "nvfp4",
                 "--out", str(tmp_path / "m7")]) == 1
    assert "version 7 has no nvfp4 weights" in capsys.readouterr().err


def test_verify_checks_a_delta_version_as_what_it_materializes_to(chain5, capsys):
    base, _ = chain5
    assert main(["verify", str(base / "delta" / "v00000003")]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and f"{base / 'delta' / 'v00000003' / 'nvfp4'}: format nvfp4" in out
