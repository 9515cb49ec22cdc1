import importlib.util
from pathlib import Path

import pytest


def _load(name: str):
    # tests/envs is not a package (its name would shadow the top-level envs), so load by path.
    path = Path(__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"tests_envs_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


chat_dir = _load("chat_dir")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A model directory: a BPE tokenizer trained here, a ChatML-style template, a generation config."""
    return chat_dir.make_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def worker_tokenizer(tmp_path_factory):
    """The model directory's tokenizer, with this process marked as an environment worker
    (``envs.isolated_worker.WORKER_ENV``) for the module's tests, as the verifiers bridge runs."""
    import os

    from convert.tokenizer import load_tokenizer
    from envs.isolated_worker import WORKER_ENV

    saved = os.environ.get(WORKER_ENV)
    os.environ[WORKER_ENV] = "1"
    yield load_tokenizer(chat_dir.make_model_dir(tmp_path_factory.mktemp("vf") / "model"))
    if saved is None:
        os.environ.pop(WORKER_ENV)
    else:
        os.environ[WORKER_ENV] = saved
