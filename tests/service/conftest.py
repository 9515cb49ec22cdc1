import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # fakes.py, certs.py


@pytest.fixture
def token() -> str:
    return "test-token-0123456789"
