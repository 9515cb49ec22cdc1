#!/usr/bin/env bash
# The GPU check of issue 17 (CUDA JAX, torch and flax installed; no downloads), under 8 minutes:
#   (a) random Qwen3-0.6B-shape model, bf16 over fp32 state, full remat, 8 x 4,096 tokens:
#       train-step tokens/s and MFU against the GPU's dense bf16 peak;
#   (b) the pallas linear log-sum-exp vs reference (max relative error), time vs a plain h @ w;
#   (c) the torch fp8 recipe's _scaled_mm linear vs a bf16 linear of the same shape.
# Writes one JSON object to $OUT/device_check.json when OUT is set, else to stdout.
#   scripts/device_check.sh [--tiny] [--attention IMPL] [--remat MODE]
# --tiny runs every part at toy shapes (on a CPU too; the test suite does) -- figures meaningless.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}
# JAX must leave room for nothing else here (torch runs afterwards, in its own process), but
# preallocating 75 % would hide the step's real peak: allocate on demand.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
jax_json=$(timeout 360 "$PY" scripts/device_check.py jax "$@" || echo '{"jax_part": "failed or timed out"}')
torch_args=()
for a in "$@"; do [ "$a" = "--tiny" ] && torch_args+=(--tiny); done
torch_json=$(timeout 90 "$PY" scripts/device_check.py torch "${torch_args[@]}" || echo '{"torch_part": "failed or timed out"}')
report=$("$PY" -c 'import json, sys; print(json.dumps({**json.loads(sys.argv[1]), **json.loads(sys.argv[2])}, indent=2))' \
  "$(echo "$jax_json" | tail -n 1)" "$(echo "$torch_json" | tail -n 1)")
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT" && echo "$report" > "$OUT/device_check.json" && echo "wrote $OUT/device_check.json"
else
  echo "$report"
fi
