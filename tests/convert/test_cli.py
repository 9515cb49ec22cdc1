"""``mixrl-convert`` end to end, as a subprocess (the installed console script when present)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from convert.cli import main
from convert.hf_checkpoint import HFCheckpoint, write_hf_checkpoint
from convert.qwen3_config import Qwen3Config, hf_tensor_shapes

CFG = Qwen3Config(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)
COMMANDS = ["import", "export", "quantize", "publish", "verify", "inspect"]


def _cli() -> list[str]:
    script = Path(sys.executable).parent / "mixrl-convert"
    return [str(script)] if script.exists() else [sys.executable, "-m", "convert.cli"]


def run(*args, ok=True):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "COLUMNS": "200"}
    proc = subprocess.run([*_cli(), *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=120)
    if ok:
        assert proc.returncode == 0, proc.stderr + proc.stdout
    return proc


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    rng = np.random.default_rng(0)
    tensors = ((n, (rng.standard_normal(s) * 0.02).astype(ml_dtypes.bfloat16))
               for n, s in hf_tensor_shapes(CFG).items())
    path = write_hf_checkpoint(tmp_path_factory.mktemp("cli") / "hf", tensors, CFG.to_hf_dict(),
                               max_shard_bytes=100_000)
    (path / "tokenizer_config.json").write_text("{}")
    return path


def test_help_for_every_command(capsys):
    out = run("--help").stdout  # the installed entry point starts
    # Each command's help in-process: a subprocess per command would cost a second apiece.
    for cmd in COMMANDS:
        assert cmd in out
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
        assert "usage: mixrl-convert " + cmd in capsys.readouterr().out.replace("\n", " ")


def test_quantize_verify_inspect(hf_dir, tmp_path):
    quant = tmp_path / "fp8"
    proc = run("quantize", "--in", hf_dir, "--format", "fp8_block", "--out", quant,
               "--engines", "mixrl")  # the tiny model's partial 128-blocks, as the engine takes
    assert "quantize fp8_block" in proc.stderr  # the progress bar
    assert run("verify", quant).stdout.startswith(f"OK {quant}: format fp8_block")
    stats = tmp_path / "stats.json"
    out = run("inspect", quant, "--against", hf_dir, "--json", stats).stdout
    assert "worst relative RMS error" in out
    rows = json.loads(stats.read_text())
    q = next(r for r in rows if r["name"] == "model.layers.0.mlp.down_proj.weight")
    assert q["stored"].startswith("fp8_block") and 0 < q["rel_rms_err"] < 0.04
    norm = next(r for r in rows if r["name"] == "model.norm.weight")
    assert norm["rel_rms_err"] == 0


def in_process(capsys, *args) -> tuple[int, str, str]:
    """Run the CLI's main() here (a subprocess costs seconds of imports; the entry point itself
    is exercised by the subprocess tests above)."""
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_import_export_round_trip(hf_dir, tmp_path, capsys):
    # In-process: these two load jax/orbax, seconds per subprocess on a busy 2-core machine.
    ckpt, exported = tmp_path / "ckpt", tmp_path / "bf16"
    code, _, err = in_process(capsys, "import", "--hf", hf_dir, "--out", ckpt)
    assert code == 0 and "wrote orbax checkpoint" in err
    assert (ckpt / "tokenizer_config.json").exists()
    assert in_process(capsys, "export", "--checkpoint", ckpt, "--out", exported, "--quiet")[0] == 0
    src, back = HFCheckpoint(hf_dir), HFCheckpoint(exported)
    assert all(np.array_equal(src.get(n), back.get(n)) for n in src.names())
    assert (exported / "tokenizer_config.json").exists()
    code, _, err = in_process(capsys, "import", "--hf", hf_dir, "--out", ckpt, "--quiet")
    assert code == 1 and "already exists" in err


def test_publish_command(hf_dir, tmp_path, capsys):
    root = tmp_path / "root"
    run("publish", "--in", hf_dir, "--root", root, "--version", 1, "--format", "bf16",
        "--format", "nvfp4", "--keep-last", "1", "--quiet")
    code, _, err = in_process(capsys, "publish", "--in", hf_dir, "--root", root, "--version", 2,
                              "--format", "bf16", "--format", "nvfp4", "--keep-last", "1")
    assert code == 0 and "published nvfp4" in err
    assert sorted(os.listdir(root)) == ["LATEST", "v00000002"]
    assert sorted(os.listdir(root / "v00000002")) == ["bf16", "nvfp4", "version.json"]


def test_corrupt_inputs_fail_cleanly_and_write_nothing(hf_dir, tmp_path, capsys):
    bad = tmp_path / "bad_hf"
    shutil.copytree(hf_dir, bad)
    shard = sorted(bad.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-64])
    proc = run("quantize", "--in", bad, "--format", "nvfp4", "--out", tmp_path / "o1", "--quiet",
               ok=False)
    assert proc.returncode == 1 and shard.name in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    code, _, err = in_process(capsys, "import", "--hf", bad, "--out", tmp_path / "o2", "--quiet")
    assert code == 1 and shard.name in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad_hf"]  # no partial outputs
    code, _, err = in_process(capsys, "quantize", "--in", tmp_path / "nowhere", "--format",
                              "bf16", "--out", tmp_path / "o3")
    assert code == 1 and "nowhere" in err
    with pytest.raises(SystemExit) as e:  # argparse usage error
        main(["quantize", "--in", str(hf_dir), "--format", "int3", "--out", "x"])
    assert e.value.code == 2


def test_verify_fails_naming_the_bad_file(hf_dir, tmp_path, capsys):
    out = tmp_path / "q"
    assert in_process(capsys, "quantize", "--in", hf_dir, "--format", "mxfp4", "--out", out,
                      "--quiet")[0] == 0
    shard = sorted(out.glob("model-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    proc = run("verify", out, ok=False)
    assert proc.returncode == 1 and shard.name in proc.stderr and "sha256" in proc.stderr
    shard.write_bytes(bytes(data[:-10]))
    code, _, err = in_process(capsys, "verify", out, "--no-manifest")
    assert code == 1 and shard.name in err.replace("\n", "")
