"""``verify`` / ``inspect`` pointed at a published version directory or publish root."""

import json
import shutil

import ml_dtypes
import numpy as np
import pytest

from convert.cli import main
from convert.publish import describe_published, publish, version_formats
from convert.qwen3_config import Qwen3Config, hf_tensor_shapes
from convert.verify import VerifyError, verify_dir

CFG = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16)
FORMATS = ["bf16", "fp8_block"]


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    rng = np.random.default_rng(0)
    params = {n: (rng.standard_normal(s) * 0.02).astype(ml_dtypes.bfloat16)
              for n, s in hf_tensor_shapes(CFG).items()}
    root = tmp_path_factory.mktemp("pub") / "weights"
    paths = publish(params, CFG, root, 12, FORMATS, engines="mixrl")  # tiny: all quantized
    return root, paths["bf16"].parent


@pytest.fixture
def version(published, tmp_path):
    """A private copy of the published version, free to damage."""
    return shutil.copytree(published[1], tmp_path / published[1].name)


def cli(capsys, *args):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err.replace("\n", "")


def test_version_formats(published, tmp_path):
    root, vdir = published
    assert version_formats(vdir) == FORMATS
    assert version_formats(vdir / "bf16") is None and version_formats(root) is None
    # A directory that merely holds an export named bf16/ is not a version.
    plain = tmp_path / "plain"
    shutil.copytree(vdir / "bf16", plain / "bf16")
    assert version_formats(plain) is None and describe_published(plain) is None


def test_verify_a_version_verifies_each_format(published, capsys):
    _, vdir = published
    code, out, err = cli(capsys, "verify", vdir)
    assert code == 0, err
    assert f"{vdir} is a published version directory holding formats bf16, fp8_block" in err
    n = len(hf_tensor_shapes(CFG))
    assert out.splitlines() == [  # fp8_block adds a weight_scale_inv per quantized projection
        f"OK {vdir / 'bf16'}: format bf16, qwen3, {n} tensors in 1 file(s)",
        f"OK {vdir / 'fp8_block'}: format fp8_block, qwen3, {n + 7} tensors in 1 file(s)"]


def test_verify_a_damaged_version_fails_naming_the_format(version, capsys):
    shard = next((version / "fp8_block").glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-8])
    shutil.rmtree(version / "bf16")  # listed in version.json, gone from disk
    code, out, err = cli(capsys, "verify", version, "--no-hashes")
    assert code == 1 and out == ""
    assert f"FAILED {version / 'bf16'}" in err and "not a directory" in err
    assert f"FAILED {version / 'fp8_block'}" in err and shard.name in err


def test_verify_a_format_dir_holding_another_format(version, capsys):
    shutil.rmtree(version / "bf16")
    shutil.copytree(version / "fp8_block", version / "bf16")
    code, _, err = cli(capsys, "verify", version)
    assert code == 1 and "holds format fp8_block, not bf16" in err


def test_verify_dir_and_inspect_refuse_a_version_or_root_in_one_line(published, capsys):
    root, vdir = published
    with pytest.raises(VerifyError) as e:
        verify_dir(vdir)
    assert e.value.problems == [
        f"{vdir} is a published version directory holding formats bf16, fp8_block: point at "
        f"one format directory, e.g. {vdir / 'bf16'}"]
    code, _, err = cli(capsys, "inspect", vdir)
    assert code == 1 and err == (
        f"mixrl-convert inspect: error: {vdir} is a published version directory holding "
        f"formats bf16, fp8_block: point at one format directory, e.g. {vdir / 'bf16'}")
    code, _, err = cli(capsys, "inspect", vdir / "fp8_block", "--against", vdir)
    assert code == 1 and "holding formats bf16, fp8_block" in err
    for cmd in ("verify", "inspect"):
        code, _, err = cli(capsys, cmd, root)
        assert code == 1
        assert f"{root} is a publish root (1 version(s); v00000012 has formats bf16, fp8_block)" \
               f": point at one format directory, e.g. {vdir / 'bf16'}" in err
    code, out, _ = cli(capsys, "inspect", vdir / "fp8_block", "--against", vdir / "bf16")
    assert code == 0 and "worst relative RMS error" in out


def test_version_without_version_json_is_still_recognised(version, capsys):
    (version / "version.json").unlink()
    assert version_formats(version) == FORMATS  # by its vNNNNNNNN name
    (version / "version.json").write_text(json.dumps({"formats": "garbage"}))
    assert version_formats(version) == FORMATS
