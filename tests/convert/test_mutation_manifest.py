"""``convert.manifest`` directly (issue 37): every check a sampler relies on before loading weights,
each problem named, on real files. Before this file the module was only exercised through exports
and the service, which left most of its mutants alive."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from convert.manifest import (
    MANIFEST_NAME,
    ManifestError,
    build_manifest,
    check_manifest,
    check_relative,
    read_manifest,
    sha256_file,
    verify_files,
    write_manifest,
)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def export(tmp_path):
    root = tmp_path / "v1"
    (root / "sub").mkdir(parents=True)
    (root / "config.json").write_bytes(b'{"a": 1}')
    (root / "sub" / "shard.bin").write_bytes(b"\x00\x01" * 50)
    (root / "empty").write_bytes(b"")
    return root


def test_sha256_of_a_path_and_of_a_descriptor_across_chunks(tmp_path):
    data = os.urandom(8 * 1024 * 1024 + 3)  # one byte-exact chunk and a short tail
    path = tmp_path / "big"
    path.write_bytes(data)
    assert sha256_file(path) == _sha(data)
    fd = os.open(path, os.O_RDONLY)
    assert sha256_file(fd) == _sha(data)
    with pytest.raises(OSError):
        os.fstat(fd)  # closed by sha256_file
    (tmp_path / "none").write_bytes(b"")
    assert sha256_file(tmp_path / "none") == _sha(b"")


def test_build_and_write_list_every_file_but_the_manifest(export):
    manifest = write_manifest(root=export, format="bf16", step=3)  # root by keyword too
    assert manifest == {
        "manifest_version": 2, "format": "bf16", "step": 3,
        "files": {"config.json": {"sha256": _sha(b'{"a": 1}'), "size": 8},
                  "empty": {"sha256": _sha(b""), "size": 0},
                  "sub/shard.bin": {"sha256": _sha(b"\x00\x01" * 50), "size": 100}}}
    text = (export / MANIFEST_NAME).read_text()
    assert json.loads(text) == manifest and text.endswith("}\n")
    assert text.index('"files"') < text.index('"format"')  # sorted keys
    again = build_manifest(export)  # manifest.json itself is never listed
    assert set(again["files"]) == set(manifest["files"]) and "format" not in again
    # digests computed while writing are taken as given, not read again
    known = build_manifest(export, known={"empty": "feed"})
    assert known["files"]["empty"] == {"sha256": "feed", "size": 0}
    assert known["files"]["config.json"]["sha256"] == _sha(b'{"a": 1}')
    with pytest.raises(ManifestError, match=r"precomputed digests for files that do not exist: \['gone'\]"):
        build_manifest(export, known={"gone": "00"})


def test_read_manifest_names_what_is_wrong(export, tmp_path):
    with pytest.raises(ManifestError, match="missing \\(an export is complete only with its manifest\\)"):
        read_manifest(export)
    path = export / MANIFEST_NAME
    cases = {"{": "malformed", '{"format": "x"}': "malformed \\('files'\\)",
             '{"files": []}': "files is not an object",
             '{"files": {"a": 3}}': "entry for 'a' lacks sha256/size",
             '{"files": {"a": {"sha256": "x"}}}': "entry for 'a' lacks sha256/size"}
    for text, message in cases.items():
        path.write_text(text)
        with pytest.raises(ManifestError, match=message):
            read_manifest(export)
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(ManifestError, match="malformed"):
        read_manifest(export)
    path.write_text('{"files": {"a": {"sha256": "x", "size": 1}}, "extra": 1}')
    assert read_manifest(export)["extra"] == 1


def test_check_manifest_reports_each_difference(export):
    assert check_manifest(export) == [f"{export / MANIFEST_NAME}: missing (an export is complete only "
                                      "with its manifest)"]
    (export / "tail.bin").write_bytes(b"123456")
    write_manifest(export)
    assert check_manifest(export) == []
    (export / "tail.bin").write_bytes(b"123")  # truncated
    (export / "extra.txt").write_text("x")
    (export / "empty").unlink()
    (export / "config.json").write_bytes(b'{"a": 12}')  # one byte longer
    shard = export / "sub" / "shard.bin"
    old, new = _sha(b"\x00\x01" * 50), _sha(b"\x00\x02" * 50)
    shard.write_bytes(b"\x00\x02" * 50)  # same size, other bytes
    problems = check_manifest(export)
    assert problems == [
        f"{export / 'extra.txt'}: not listed in manifest.json",
        f"{export / 'config.json'}: size 9 bytes, manifest.json says 8 (truncated or replaced)",
        f"{export / 'empty'}: listed in manifest.json but missing",
        f"{export / 'tail.bin'}: size 3 bytes, manifest.json says 6 (truncated or replaced)",
        f"{shard}: sha256 {new[:16]}... does not match manifest.json ({old[:16]}...); corrupt"]
    assert check_manifest(export, hashes=False) == problems[:4]  # sizes only: no hashing


def test_check_relative_refuses_paths_that_escape():
    for rel in ("config.json", "sub/shard.bin", "a..b", "..a/b"):
        check_relative(rel)
    for rel in ("/etc/passwd", "../x", "sub/../../x", "a/.."):
        with pytest.raises(ManifestError, match=f"manifest path '{rel}' escapes the weights directory"):
            check_relative(rel)


def test_verify_files_checks_only_the_listed_ones(export):
    files = {"config.json": (8, _sha(b'{"a": 1}')), "sub/shard.bin": (100, _sha(b"\x00\x01" * 50))}
    assert verify_files(export, files) == []  # "empty" is not listed: extras are allowed
    bad = {**files, "gone": (1, "00"), "../up": (1, "00"), "config.json": (9, _sha(b'{"a": 1}')),
           "sub/shard.bin": (100, _sha(b"other")), "empty": (0, _sha(b""))}
    (export / "empty").write_bytes(b"x")  # longer than listed
    assert verify_files(export, bad) == [
        "manifest path '../up' escapes the weights directory",
        f"{export / 'config.json'}: size 8 bytes, the manifest says 9",
        f"{export / 'empty'}: size 1 bytes, the manifest says 0",
        f"{export / 'gone'}: missing",
        f"{export / 'sub/shard.bin'}: sha256 does not match the manifest (corrupt)"]


@pytest.mark.parametrize("tensors", ['["w"]', '{"w": 3}', '{"w": null}', '"w"'])
def test_read_manifest_refuses_per_tensor_digests_that_are_no_name_to_sha256_object(export, tensors):
    """A version-2 entry's ``tensors`` maps tensor names to sha256 strings; anything else is a
    malformed manifest, named where it is read (a list or a number there broke the tensor checks
    later, outside ``ManifestError``)."""
    path = export / MANIFEST_NAME
    entry = {"sha256": "ab", "size": 1, "tensors": json.loads(tensors)}
    path.write_text(json.dumps({"files": {"m.safetensors": entry}}))
    with pytest.raises(ManifestError, match=r"malformed \(tensors of 'm.safetensors' is not a name -> sha256 "
                                            r"object\)$"):
        read_manifest(export)
    path.write_text('{"files": {"m.safetensors": {"sha256": "ab", "size": 1, "tensors": {"w": "cd"}}}}')
    assert read_manifest(export)["files"]["m.safetensors"]["tensors"] == {"w": "cd"}


def test_files_and_problems_come_in_path_order(export):
    """``build_manifest`` lists the files in path order, as the written (sorted) manifest.json reads
    back, and ``check_manifest`` reports unlisted files in that order: two runs over the same
    directory, or a manifest built in memory and one read from disk, list alike."""
    manifest = write_manifest(export)
    assert list(manifest["files"]) == ["config.json", "empty", "sub/shard.bin"]
    assert list(read_manifest(export)["files"]) == list(manifest["files"])
    for name in ("b.txt", "a.txt", "c/d.txt"):
        (export / name).parent.mkdir(exist_ok=True)
        (export / name).write_text("x")
    assert check_manifest(export) == [f"{export / n}: not listed in manifest.json"
                                      for n in ("a.txt", "b.txt", "c/d.txt")]
