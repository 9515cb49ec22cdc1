#!/usr/bin/env bash
# Train with mixrl on a multi-GPU host: one process drives every local GPU (the mesh: mesh:).
#
#   scripts/launch_gpu_host.sh CONFIG [key=value ...] [extra mixrl-train args]
#       mixrl-train --config CONFIG ...: the training job
#   scripts/launch_gpu_host.sh --check CONFIG [key=value ...]
#       the scale-out smoke check instead (mesh, sharded steps, memory report, docs/scale_out.md)
#   MIXRL_CMD="<program>" runs any other program that takes --config
#
# Python: $PYTHON, else the active venv ($VIRTUAL_ENV/bin/python), else python3 on PATH (e.g.
# PYTHON=/opt/venv/bin/python scripts/launch_gpu_host.sh CONFIG).
#
# Several hosts without a cluster manager: start it on every host with
#   NNODES=2 NODE_RANK=0|1 COORDINATOR=host0:12345 scripts/launch_gpu_host.sh CONFIG mesh.dcn_data=2
# (under SLURM use scripts/slurm_gpu.sbatch: JAX reads the same from SLURM's environment).
set -euo pipefail

check=
if [[ ${1:-} == --check ]]; then check=1; shift; fi
[[ $# -ge 1 ]] || { awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 2; }
config=$1
shift
cd "$(dirname "$0")/.."

# Let JAX take most of each GPU up front (the trainer is the only tenant), and let XLA overlap
# the FSDP all-gathers / gradient reduce-scatters with compute.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true"

if [[ -n "${NNODES:-}" && "$NNODES" -gt 1 ]]; then
  export MIXRL_NUM_PROCESSES=$NNODES
  export MIXRL_PROCESS_ID=${NODE_RANK:?NODE_RANK is required with NNODES > 1}
  export MIXRL_COORDINATOR_ADDRESS=${COORDINATOR:?COORDINATOR=host:port is required with NNODES > 1}
fi

if [[ -n ${PYTHON:-} ]]; then py=$PYTHON
elif [[ -n ${VIRTUAL_ENV:-} ]]; then py=$VIRTUAL_ENV/bin/python
else py=python3
fi
program=("$py" -m trainer_jax.cli)
[[ -n $check ]] && program=("$py" -m trainer_jax.parallel.check)
if [[ -n ${MIXRL_CMD:-} ]]; then read -r -a program <<< "$MIXRL_CMD"; fi
exec "${program[@]}" --config "$config" "$@"
