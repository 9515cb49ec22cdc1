"""convert/ sits below the trainer and the samplers: it imports neither, and reaches their
readers only through the ``mixrl.convert`` entry points (convert.plugins)."""

import ast
import json
import subprocess
import sys
import textwrap
from importlib.metadata import EntryPoint
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from convert import plugins
from convert.cli import main
from convert.hf_checkpoint import write_hf_checkpoint
from convert.qwen3_config import Qwen3Config, hf_tensor_shapes
from convert.sources import SourceError, open_source

ABOVE = ["trainer_jax", "sampler_torch", "envs", "torch", "jax", "flax"]
CFG = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16)

# Runs in a fresh interpreter: this test process has long imported torch and jax.
_PROBE = textwrap.dedent("""
    import importlib, json, pkgutil, sys
    import convert

    names = sorted(m.name for m in pkgutil.walk_packages(convert.__path__, "convert."))
    for name in names:
        importlib.import_module(name)
    above = %r
    after_import = sorted({m.split(".")[0] for m in sys.modules} & set(above))

    from convert import plugins
    plugins.load_providers()  # the providers' registration must be as light as convert itself
    after_providers = sorted({m.split(".")[0] for m in sys.modules} & set(above))
    print(json.dumps({"modules": names, "after_import": after_import,
                      "after_providers": after_providers,
                      "readers": [r.name for r in plugins.source_readers()],
                      "calibrator": plugins.kv_calibrator().name,
                      "failed": dict(plugins.failed_providers())}))
""")


def test_convert_imports_nothing_above_it():
    proc = subprocess.run([sys.executable, "-c", _PROBE % ABOVE], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert {"convert.cli", "convert.sources", "convert.plugins", "convert.formats.nvfp4"} <= set(
        got["modules"])
    assert got["after_import"] == []
    # Loading the providers imports their registering modules, never torch/jax/flax.
    assert not {"torch", "jax", "flax"} & set(got["after_providers"])
    assert got["readers"] == ["trainer_checkpoint"] and got["calibrator"] == "sampler_torch"
    assert got["failed"] == {}


def test_no_import_of_anything_above_even_inside_functions():
    # The subprocess check above cannot see imports deferred into function bodies.
    root = Path(__file__).resolve().parents[2] / "convert"
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            found += [f"{path.name}:{node.lineno} {n}" for n in names
                      if n.split(".")[0] in ABOVE]
    assert found == []


@pytest.fixture
def empty_registry(monkeypatch):
    """A registry that loads ``entry_points`` set by the test instead of the installed ones."""
    monkeypatch.setattr(plugins, "_loaded", False)
    monkeypatch.setattr(plugins, "_source_readers", {})
    monkeypatch.setattr(plugins, "_kv_calibrators", {})
    monkeypatch.setattr(plugins, "_failed", {})

    def use(*values: str) -> None:
        eps = [EntryPoint(name=f"p{i}", value=v, group=plugins.ENTRY_POINT_GROUP)
               for i, v in enumerate(values)]
        monkeypatch.setattr(plugins.importlib.metadata, "entry_points", lambda group: eps)

    return use


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    rng = np.random.default_rng(0)
    tensors = ((n, rng.standard_normal(s).astype(ml_dtypes.bfloat16))
               for n, s in hf_tensor_shapes(CFG).items())
    return write_hf_checkpoint(tmp_path_factory.mktemp("layering") / "hf", tensors,
                               CFG.to_hf_dict())


def fake_training_checkpoint(root: Path) -> Path:
    (root / "7" / "state").mkdir(parents=True)
    return root


def test_an_unloadable_provider_is_named_with_what_to_install(empty_registry, hf_dir, tmp_path,
                                                              capsys):
    empty_registry("mixrl_no_such_package.reader:register")
    ckpt = fake_training_checkpoint(tmp_path / "ckpt")
    with pytest.raises(SourceError, match="not an HF directory") as e:
        open_source(ckpt, CFG)
    assert "mixrl_no_such_package" in str(e.value) and "pip install mixrl_no_such_package" in str(
        e.value)
    ids = tmp_path / "ids.json"
    ids.write_text("[[1, 2, 3]]")
    code = main(["quantize", "--in", str(hf_dir), "--format", "bf16", "--out",
                 str(tmp_path / "q"), "--kv-calibration", str(ids), "--quiet"])
    err = capsys.readouterr().err.replace("\n", "")
    assert code == 1 and "none is registered" in err and "mixrl_no_such_package" in err
    assert "Traceback" not in err and not (tmp_path / "q").exists()


def test_no_providers_at_all_says_how_to_get_them(empty_registry, hf_dir):
    empty_registry()
    with pytest.raises(plugins.PluginError, match="entry points"):
        plugins.kv_calibrator()


def test_a_provider_missing_its_package_fails_in_one_line(monkeypatch, hf_dir, tmp_path, capsys):
    # torch / jax "not installed": a None entry in sys.modules makes find_spec and import fail.
    monkeypatch.setitem(sys.modules, "torch", None)
    ids = tmp_path / "ids.json"
    ids.write_text("[[1, 2, 3]]")
    code = main(["quantize", "--in", str(hf_dir), "--format", "bf16", "--out",
                 str(tmp_path / "q"), "--kv-calibration", str(ids), "--quiet"])
    err = capsys.readouterr().err
    assert code == 1 and "needs torch (not installed): pip install torch" in err.replace("\n", "")
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "q").exists()

    monkeypatch.setitem(sys.modules, "jax", None)
    ckpt = fake_training_checkpoint(tmp_path / "ckpt")
    code = main(["export", "--checkpoint", str(ckpt), "--config", str(hf_dir), "--out",
                 str(tmp_path / "e"), "--quiet"])
    err = capsys.readouterr().err.replace("\n", "")
    assert code == 1 and "reading a training checkpoint needs jax" in err
    assert "pip install jax" in err and not (tmp_path / "e").exists()


def test_registered_readers_come_first_and_get_the_config(empty_registry, hf_dir, tmp_path):
    empty_registry()
    seen = []

    def read(path, cfg, step):
        seen.append((path, cfg["hidden_size"], step))
        yield "x", np.zeros(1)

    plugins.register_source_reader("test", lambda p: (p / "MARK").exists(), read,
                                   description="a test source")
    marked = tmp_path / "m"
    marked.mkdir()
    (marked / "MARK").write_text("")
    with pytest.raises(SourceError, match="is a test source, which stores no model config"):
        open_source(marked)
    assert list(open_source(marked, CFG, step=3).open()) == [("x", np.zeros(1))]
    assert seen == [(marked, 32, 3)]
    assert open_source(hf_dir).files_dir == hf_dir  # everything else as before
    with pytest.raises(SourceError, match="a mixrl orbax checkpoint or a test source$"):
        open_source(tmp_path / "nowhere")


def test_calibrator_output_is_checked(empty_registry, hf_dir):
    from convert.kv_calibration import calibrate_kv_scales

    empty_registry()
    plugins.register_kv_calibrator(lambda d, ids: {0: (0.5, float("nan"))})
    with pytest.raises(ValueError, match="layer 0"):
        calibrate_kv_scales(hf_dir, [[1, 2]])
