import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # fakes.py, certs.py


@pytest.fixture
def token() -> str:
    return "test-token-0123456789"


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """Two versions of the tiny model published by the converter; version 2 corrupted after the
    fact (one shard's byte flipped: same size, only the sha256 can tell)."""
    from tiny import tiny_char_model

    from convert.publish import publish
    root = tmp_path_factory.mktemp("weights")
    init = tiny_char_model(root / "init")
    v1 = publish(init, None, root / "pub", 1, ["bf16"], keep_last=None)
    v2 = publish(init, None, root / "pub", 2, ["bf16"], keep_last=None)
    shard = next(v2["bf16"].glob("*.safetensors"))
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0xFF  # same size, different bytes: only the sha256 can tell
    shard.write_bytes(bytes(raw))
    return v1, v2
