import os
import shutil
import tempfile

import pytest

# Tests run on CPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The suite's tiny models spend most of their time in XLA's compiler, not running. Settings for
# the test session only (benchmarks and real runs keep XLA's defaults): skip LLVM's optimisation
# passes (compiles about twice as fast; the tiny steps barely slow down); XLA's older CPU fusion
# emitters (a fifth less CPU again: 226 -> 185 s for the integration, parity, remat and crash test
# files, 66 -> 38 s for test_learner.py; the mesh cases whose 1e-5 comparisons they move, the
# context-parallel step's, compile with today's emitters: tests/parallel/test_mesh_cases.py); and
# one persistent compilation cache shared between the tests and every trainer or sampler process
# they start (the crash and integration tests start the same trainer several times). The cache is
# new for each session and removed at its end, so no run ever reads another run's executables.
_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
_own_cache: str | None = None


def pytest_configure(config):
    global _own_cache
    config.addinivalue_line("markers", "off_loopback_expected: the test makes an off-loopback peer on "
                            "purpose (in a network namespace of its own); the loopback watch skips it")
    flags = os.environ.get("XLA_FLAGS", "")
    flags += "".join(f" {f}" for f in _FLAGS if f.split("=")[0] not in flags)  # one set by hand wins
    os.environ["XLA_FLAGS"] = flags.strip()
    if _CACHE_ENV not in os.environ:
        _own_cache = tempfile.mkdtemp(prefix="mixrl-test-jax-cache-")
        os.environ[_CACHE_ENV] = _own_cache
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


def pytest_unconfigure(config):
    if _own_cache:
        shutil.rmtree(_own_cache, ignore_errors=True)


# The files that take minutes of the 2-core CI machine, longest first. `make test` hands whole
# files to its two workers (--dist loadfile) in collection order (--no-loadscope-reorder: xdist's
# own order, most tests first, put these one- or few-test files last, and one worker then ran the
# last of them alone for minutes). Started first, the short files fill in around them at the end.
# Only an order: a file missing from the list runs all the same (tests/test_suite_order.py keeps
# the names current).
HEAVY_FIRST = (
    "parallel/test_mesh_cases.py",
    "test_shipped_configs.py",
    "parallel/test_multiprocess_training.py",
    "fleet/test_ray_fleet.py",
    "trainer/test_crash_recovery.py",
    "trainer/test_train_integration.py",
    "trainer/test_dataset_e2e.py",
    "cost/test_cost_run.py",
    "trainer/test_sync.py",
    "parallel/test_multiprocess.py",
    "models/test_device_check.py",
)


def pytest_collection_modifyitems(session, config, items):
    here = os.path.dirname(__file__)
    rank = {os.path.join(here, p): i for i, p in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(str(item.path), len(rank)))  # stable: the rest keep their order


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
