#!/usr/bin/env bash
# Run mixrl on every host of a Cloud TPU slice: one process per host, the same command on all.
#
#   scripts/launch_tpu_slice.sh setup TPU_NAME ZONE
#       copy this checkout (git-tracked files) to every host and install it with jax[tpu]
#       into ~/mixrl/.venv there
#   scripts/launch_tpu_slice.sh run TPU_NAME ZONE CONFIG [key=value ...] [mixrl-train flags ...]
#       mixrl-train --config CONFIG on every host (the training job); the overrides and flags
#       (e.g. --resume, --run-dir DIR) follow --config CONFIG unchanged
#   scripts/launch_tpu_slice.sh check TPU_NAME ZONE CONFIG [key=value ...]
#       the scale-out smoke check on every host instead (mesh, sharded steps, memory report);
#       MIXRL_CMD="<program>" runs any other program that takes --config
#   scripts/launch_tpu_slice.sh stop TPU_NAME ZONE
#       kill leftover mixrl processes on every host (they hold the TPU chips)
#
# Python on each host: $PYTHON (a path valid on the hosts), else the host's active venv
# ($VIRTUAL_ENV/bin/python), else the checkout's .venv/bin/python (what setup installs), else
# python3 on the host's PATH. Environment: MIXRL_REMOTE_DIR (default ~/mixrl), DRY_RUN=1 prints
# the gcloud commands only. jax.distributed needs nothing: on a slice JAX reads the coordinator,
# process count and id from the TPU metadata server (distributed.mode: "on" in
# configs/tpu_slice.yaml). See docs/scale_out.md.
set -euo pipefail

usage() { awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 2; }
[[ $# -ge 3 ]] || usage
action=$1 tpu=$2 zone=$3
shift 3
remote_dir=${MIXRL_REMOTE_DIR:-'~/mixrl'}

gcloud_tpu() {  # gcloud_tpu ssh|scp ARGS...: every worker of the slice
  local cmd=(gcloud compute tpus tpu-vm "$1" --zone "$zone" --worker=all "${@:2}")
  if [[ -n "${DRY_RUN:-}" ]]; then printf '%q ' "${cmd[@]}"; echo; else "${cmd[@]}"; fi
}

case $action in
  setup)
    archive=$(mktemp -d)/mixrl.tar.gz
    trap 'rm -rf "$(dirname "$archive")"' EXIT  # the local copy, once it is on the hosts
    git -C "$(dirname "$0")/.." archive --format=tar.gz -o "$archive" HEAD
    gcloud_tpu scp "$archive" "$tpu:/tmp/mixrl.tar.gz"
    gcloud_tpu ssh "$tpu" --command "mkdir -p $remote_dir && tar -xzf /tmp/mixrl.tar.gz -C $remote_dir \
      && cd $remote_dir && python3 -m venv .venv && .venv/bin/pip install -q -e '.[tpu]'"
    ;;
  run|check)
    [[ $# -ge 1 ]] || usage
    config=$1
    shift
    # The interpreter is found on each host, in its checkout (single quotes: expanded there).
    find_py='py=${VIRTUAL_ENV:+$VIRTUAL_ENV/bin/python}; [ -n "$py" ] || py=.venv/bin/python;'
    find_py+=' [ -x "$py" ] || py=python3;'
    if [[ -n ${PYTHON:-} ]]; then find_py="py=$(printf '%q' "$PYTHON");"; fi
    default='"$py" -m trainer_jax.cli'
    [[ $action == check ]] && default='"$py" -m trainer_jax.parallel.check'
    program=${MIXRL_CMD:-$default}
    # No overrides: nothing at all after CONFIG (printf '%q ' with no argument prints '', which
    # the program would read as an empty override).
    args=
    if [[ $# -gt 0 ]]; then args=$(printf ' %q' "$@"); fi
    # Every host logs to logs/<hostname>.log in the checkout on that host and to this terminal;
    # pipefail: a host's status is the trainer's, not tee's (a failed run must not exit 0).
    gcloud_tpu ssh "$tpu" --command "set -o pipefail; cd $remote_dir && mkdir -p logs || exit; $find_py \
$program --config $(printf '%q' "$config")$args 2>&1 | tee logs/\$(hostname).log"
    ;;
  stop)
    gcloud_tpu ssh "$tpu" --command "pkill -u \$USER -f 'python.*(trainer_jax|mixrl-train)' || true"
    ;;
  *) usage ;;
esac
