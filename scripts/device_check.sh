#!/usr/bin/env bash
# The GPU check of issues 17 and 30 (CUDA JAX, torch and flax installed; no downloads), in one
# invocation of at most 7 minutes (each part has its own deadline, so one failure or hang cannot
# hide the others' figures; on an H200 the whole should take well under that):
#   (b) kernels  every fused kernel `auto` may pick here against the reference -- the Pallas
#                linear log-sum-exp; pallas_gpu and cudnn attention on packed rows (splash on
#                TPU) -- recorded in the checked-kernel registry trainer_jax/kernels/checked.json
#                (kernel x platform x device kind x jax minor; see trainer_jax/kernels/checked.py)
#   (a) jax      random Qwen3-0.6B-shape model, bf16 over fp32 state, full remat, 8 x 4,096
#                tokens, with the kernels auto now picks: train-step tokens/s and MFU
#   (c) torch    the torch fp8 recipe's _scaled_mm linear vs a bf16 linear of the same shape
#   (d) train    a real mixrl-train of 3 steps (configs/device_check.yaml): the JAX trainer
#                (XLA_PYTHON_CLIENT_MEM_FRACTION=0.45) and one spawned sampler group on the same
#                GPU; step times, the kernels chosen, the sampler's device lines
# Writes one JSON object to $OUT/device_check.json (and the registry to $OUT/checked.json) when
# OUT is set, else prints it.
#   scripts/device_check.sh [--tiny] [--registry PATH] [--attention IMPL] [--remat MODE]
# --tiny runs every part at toy shapes on a CPU (the test suite does; figures meaningless) and
# never writes the repository's registry: give --registry (or MIXRL_CHECKED_KERNELS) for that.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # a checkout need not be installed
# JAX must leave room for nothing else in (a)/(b) (torch runs afterwards, in its own process), but
# preallocating 75 % would hide the step's real peak: allocate on demand. (d) sets its own.
export XLA_PYTHON_CLIENT_PREALLOCATE=false

tiny=() jax_args=() registry=""
while [ $# -gt 0 ]; do
  case "$1" in
    --tiny) tiny=(--tiny); jax_args+=(--tiny) ;;
    --registry) registry="$2"; shift ;;
    --registry=*) registry="${1#*=}" ;;
    *) jax_args+=("$1") ;;
  esac
  shift
done
# One registry for every part: (b) writes it, (a) and (d) read it through auto.
if [ -n "$registry" ]; then export MIXRL_CHECKED_KERNELS="$registry"; fi
if [ -z "${MIXRL_CHECKED_KERNELS:-}" ] && [ ${#tiny[@]} -eq 0 ]; then
  export MIXRL_CHECKED_KERNELS="$PWD/trainer_jax/kernels/checked.json"
fi

part() {  # part NAME DEADLINE_S ARGS...: its JSON line, or one naming the failure
  local name=$1 limit=$2 out rc=0
  shift 2
  out=$(timeout -k 10 "$limit" "$PY" scripts/device_check.py "$@" 2>"$tmp/$name.err") || rc=$?
  local last; last=$(printf '%s\n' "$out" | tail -n 1)
  if [ $rc -eq 0 ] && [ -n "$last" ]; then printf '%s\n' "$last"; return; fi
  local why="exit $rc"
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then why="timed out after ${limit} s"; fi
  "$PY" -c 'import json, sys; print(json.dumps({sys.argv[1] + "_part": sys.argv[2], sys.argv[1] + "_stderr_tail": sys.argv[3][-1500:]}))' \
    "$name" "$why" "$(tail -c 1500 "$tmp/$name.err" 2>/dev/null)"
}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
# On the accelerator the parts run one after another (each measures the device alone; (b) must
# have written the registry before (a) and (d) read it). --tiny figures mean nothing: its parts
# run side by side, so the test suite's CPU run stays short.
run_part() { local t0=$SECONDS; part "$@" > "$tmp/$1.json"; echo $((SECONDS - t0)) > "$tmp/$1.s"; }
if [ ${#tiny[@]} -eq 0 ]; then
  run_part kernels 120 kernels  # deadlines: 7 minutes in all at worst
  run_part jax 120 jax "${jax_args[@]}"
  run_part torch 45 torch
  run_part train 135 train --timeout 120
else
  # (a shared CPU can be many times slower than an idle one: deadlines for hangs, not for speed)
  # XLA:CPU's backend optimisations cost most of a toy step's compile and buy nothing here.
  export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_backend_optimization_level=0"
  run_part kernels 400 kernels --tiny & run_part jax 400 jax "${jax_args[@]}" &
  run_part torch 400 torch --tiny & run_part train 400 train --tiny --timeout 380 &
  wait
fi
report=$("$PY" - "$tmp" kernels jax torch train <<'EOF'
import json, sys
from pathlib import Path
tmp, names = Path(sys.argv[1]), sys.argv[2:]
report = {}
for name in names:
    report.update(json.loads((tmp / f"{name}.json").read_text()))
report["part_seconds"] = {name: int((tmp / f"{name}.s").read_text()) for name in names}
print(json.dumps(report, indent=2))
EOF
)
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT" && echo "$report" > "$OUT/device_check.json" && echo "wrote $OUT/device_check.json"
  if [ -n "${MIXRL_CHECKED_KERNELS:-}" ] && [ -f "$MIXRL_CHECKED_KERNELS" ]; then
    cp "$MIXRL_CHECKED_KERNELS" "$OUT/checked.json" && echo "wrote $OUT/checked.json"
  fi
else
  echo "$report"
fi
