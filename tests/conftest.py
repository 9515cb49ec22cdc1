import os
import shutil
import tempfile

import pytest

# Tests run on CPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The suite's tiny models spend most of their time in XLA's compiler, not running. Two settings
# for the test session only (benchmarks and real runs keep XLA's defaults): skip LLVM's
# optimisation passes (compiles about twice as fast; the tiny steps barely slow down), and share
# one persistent compilation cache between the tests and every trainer or sampler process they
# start (the crash and integration tests start the same trainer several times). The cache is
# new for each session and removed at its end, so no run ever reads another run's executables.
_OPT_LEVEL = "--xla_backend_optimization_level=0"
_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
_own_cache: str | None = None


def pytest_configure(config):
    global _own_cache
    config.addinivalue_line("markers", "off_loopback_expected: the test makes an off-loopback peer on "
                            "purpose (in a network namespace of its own); the loopback watch skips it")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_OPT_LEVEL}".strip()
    if _CACHE_ENV not in os.environ:
        _own_cache = tempfile.mkdtemp(prefix="mixrl-test-jax-cache-")
        os.environ[_CACHE_ENV] = _own_cache
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


def pytest_unconfigure(config):
    if _own_cache:
        shutil.rmtree(_own_cache, ignore_errors=True)

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


# Loopback only: the suite's processes talk to 127.0.0.0/8 and nothing else. While every test runs,
# a thread samples the sockets of this process and all its descendants (tests/loopback.py); a
# connection to a peer off loopback fails the test at teardown, naming the process and the peer.
# A listener on 0.0.0.0 is fine: only peers count. Daemons that are nobody's child (Ray's) are
# added by their test: ``loopback_only.add(lambda: pids)``.
@pytest.fixture(autouse=True)
def loopback_only(request):
    from loopback import LoopbackWatch, tree

    if request.node.get_closest_marker("off_loopback_expected"):
        yield None
        return
    me = os.getpid()
    watch = LoopbackWatch(lambda: tree(me)).start()
    yield watch
    found = watch.stop()
    if found:
        pytest.fail(f"{len(found)} connection(s) to a peer off 127.0.0.0/8 during this test:\n  "
                    + "\n  ".join(found[:20]), pytrace=False)
