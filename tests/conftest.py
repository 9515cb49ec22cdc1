import os

import pytest

# Tests run on CPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    """``hf_model_dir(name) -> (path, transformers model)``, saved once per session."""
    cache = {}

    def make(name: str):
        from tiny_models import build_hf_model

        if name not in cache:
            model = build_hf_model(name)
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path)
            cache[name] = (path, model)
        return cache[name]

    return make
