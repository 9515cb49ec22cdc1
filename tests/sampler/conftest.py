import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Sampler tests run torch on one thread.

    Two shared cores: OpenMP spin-waiting across busy cores makes tiny matmuls 50x slower.
    """
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
