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
