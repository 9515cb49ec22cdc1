# Two entry points: `make demo` (the main job on the local default config) and `make test`.
# Both create .venv on first use. torch is installed first and pinned. Which build: PyPI's Linux
# wheel of torch is the CUDA build (several GB of CUDA libraries), right for a GPU machine; on a
# machine without `nvidia-smi` the CPU build comes from PyTorch's CPU index when that index answers,
# else from pip's configured sources (where a local wheel directory may hold a +cpu build).
# TORCH_INDEX=URL forces an index.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mixrl-installed
comma := ,
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# (recursively expanded: the probe runs only when the install recipe below uses it)
TORCH_INDEX ?= $(shell if ! command -v nvidia-smi >/dev/null 2>&1 && \
	$(PYTHON) -c "import urllib.request as u; u.urlopen('$(TORCH_CPU_INDEX)/', timeout=5)" \
	>/dev/null 2>&1; then echo $(TORCH_CPU_INDEX); fi)

.PHONY: venv demo test lint bench clean

venv: $(STAMP)

# $(call make_venv,DIR,EXTRAS): a venv at DIR with torch pinned (chosen as above), then the project
# editable with EXTRAS; the stamp file is written last, so an interrupted install is redone.
# Byte-compiled once, on every core: pip compiles what it installs file by file on one core (about
# three quarters of the install's CPU: torch, jax, ray, transformers), and it must happen here,
# since where PYTHONDONTWRITEBYTECODE is set nothing writes .pyc files later and every process
# would compile each module it imports at each start. -qq: files that do not compile are skipped,
# as pip skips them.
define make_venv
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	$(1)/bin/python -m pip install -q --no-compile torch==$(TORCH_VERSION) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(1)/bin/python -m pip install -q --no-compile -e '.[$(2)]'
	$(1)/bin/python -m compileall -qq -j 0 $(1)/lib || true
	touch $(1)/.mixrl-installed
endef

$(STAMP): pyproject.toml
	$(call make_venv,$(VENV),dev)

demo: $(STAMP)
	$(VENV)/bin/mixrl-train --config configs/local_mixed.yaml

# -m 'not slow': slow tests are benchmarks in disguise; run them with `make test-slow`.
# TEST_WORKERS pytest-xdist workers, each taking whole test files (module fixtures stay shared) in
# collection order, the longest files first (tests/conftest.py, HEAVY_FIRST).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -m 'not slow and not gpu' --timeout=900 --durations=40 -n $(TEST_WORKERS) --dist loadfile \
		--no-loadscope-reorder

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow --timeout=3600

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# Mutation testing of the core (docs/testing.md; not in CI): in a clone under MUTATE_DIR, niced,
# resumable. MODULE=name (default: every core module), SAMPLE=N SEED=S: a seeded sample per module.
.PHONY: mutate
mutate: $(STAMP)
	$(PY) scripts/mutate.py $(if $(MODULE),--module $(MODULE)) $(if $(SAMPLE),--sample $(SAMPLE)) \
		$(if $(SEED),--seed $(SEED)) $(if $(MUTATE_DIR),--workdir $(MUTATE_DIR))

clean:
	rm -rf $(VENV) .pytest_cache

# env: openenv in its own venv (docs/environments.md): OpenEnv 0.10's fastmcp 3 needs mcp < 2, the
# verifiers extra (in dev) pins mcp 2.0, so .venv-openenv holds the openenv and test extras, no
# verifiers; torch pinned and chosen as for .venv. `make test-openenv`: the OpenEnv tests in it.
OPENENV_VENV ?= .venv-openenv
OPENENV_PY := $(OPENENV_VENV)/bin/python
OPENENV_STAMP := $(OPENENV_VENV)/.mixrl-installed

.PHONY: venv-openenv test-openenv
venv-openenv: $(OPENENV_STAMP)

$(OPENENV_STAMP): pyproject.toml
	$(call make_venv,$(OPENENV_VENV),openenv$(comma)test)

test-openenv: $(OPENENV_STAMP)
	$(OPENENV_PY) -m pytest -q --timeout=900 --durations=5 tests/envs/test_env_openenv.py \
		tests/envs/test_byo_readme.py -k openenv
