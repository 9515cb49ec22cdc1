"""The generated modules in mixrl_wire/v1 match what protoc makes from proto/ today."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_generated_code_is_in_sync_with_proto():
    pytest.importorskip("grpc_tools")
    out = subprocess.run([sys.executable, "-m", "mixrl_wire.codegen", "--check"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_generated_modules_do_not_import_a_top_level_proto_or_mixrl_package():
    for path in (REPO / "mixrl_wire" / "v1").glob("*_pb2*.py"):
        text = path.read_text()
        assert "from mixrl.v1 import" not in text and "import proto" not in text, path


def _copy_generated(tmp_path: Path) -> Path:
    root = tmp_path / "wire"
    (root / "v1").mkdir(parents=True)
    for path in (REPO / "mixrl_wire" / "v1").glob("*_pb2*.py*"):
        (root / "v1" / path.name).write_text(path.read_text())
    return root


def test_a_newer_generator_release_alone_is_not_a_difference(tmp_path):
    """A fresh clone resolves whatever grpcio-tools is newest: only its version stamps change."""
    pytest.importorskip("grpc_tools")
    from mixrl_wire import codegen

    root = _copy_generated(tmp_path)
    grpc_file, pb_file = root / "v1" / "rollout_pb2_grpc.py", root / "v1" / "rollout_pb2.py"
    text = grpc_file.read_text()
    assert "GRPC_GENERATED_VERSION = '" in text
    grpc_file.write_text(codegen._STAMPS[0].sub(r"\g<1>'9.99.9'", text))
    pb = pb_file.read_text()
    restamped = codegen._STAMPS[2].sub(r"\g<1>\n    99,\n    98,\n    97,\n    '',", pb)
    assert restamped != pb, "the runtime-version stamp was not found"
    pb_file.write_text(codegen._STAMPS[1].sub(r"\g<1>99.98.97", restamped))
    assert codegen.stale(root) == []


def test_a_real_difference_is_one_failure_naming_both_generator_releases(tmp_path):
    pytest.importorskip("grpc_tools")
    from mixrl_wire import codegen

    root = _copy_generated(tmp_path)
    grpc_file = root / "v1" / "rollout_pb2_grpc.py"
    text = codegen._STAMPS[0].sub(r"\g<1>'1.0.0'", grpc_file.read_text())
    grpc_file.write_text(text.replace("class RolloutStub:", "class RolloutStubRenamed:"))
    problems = codegen.stale(root)
    assert len(problems) == 1, problems
    assert "rollout_pb2_grpc.py" in problems[0] and "generator 1.0.0" in problems[0]
    fresh_version = codegen.stamp_of((REPO / "mixrl_wire" / "v1" / "rollout_pb2_grpc.py").read_text())
    assert fresh_version != "unknown"
