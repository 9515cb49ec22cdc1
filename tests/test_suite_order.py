"""tests/conftest.py's HEAVY_FIRST (the files `make test` starts first) names files that exist."""

from pathlib import Path


def test_heavy_first_names_existing_test_files(request):
    conftest = request.config.pluginmanager.get_plugin(str(Path(__file__).parent / "conftest.py"))
    missing = [p for p in conftest.HEAVY_FIRST if not (Path(__file__).parent / p).is_file()]
    assert conftest.HEAVY_FIRST and not missing, f"tests/conftest.py HEAVY_FIRST: no such file {missing}"
