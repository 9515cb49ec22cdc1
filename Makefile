# Two entry points: `make demo` (the main job on the local default config) and `make test`.
# Both create .venv on first use. torch is installed first and pinned so pip picks the CPU build
# that lies on this machine instead of resolving a multi-GB CUDA wheel.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mixrl-installed
TORCH_VERSION ?= 2.13.0

.PHONY: venv demo test lint bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mixrl-train --config configs/local_mixed.yaml

# -m 'not slow': slow tests are benchmarks in disguise; run them with `make test-slow`.
# TEST_WORKERS pytest-xdist workers, each taking whole test files (module fixtures stay shared).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -m 'not slow and not gpu' --timeout=900 --durations=15 -n $(TEST_WORKERS) --dist loadfile

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow --timeout=3600

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache
