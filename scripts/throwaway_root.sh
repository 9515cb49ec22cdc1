#!/usr/bin/env bash
# Run a command as root on a throwaway copy of this machine, for code that may do harm as root
# (the sandbox's mutants: one chowned / and /tmp of the machine that ran it; docs/testing.md).
#
#   scripts/throwaway_root.sh [--keep DIR]... -- COMMAND [ARG]...
#
# The command sees the same files, but every write below / lands in a tmpfs overlay that is
# dropped when it ends; only the --keep directories (created if missing) are the real ones, bound
# read-write (results to take away). It runs in new mount, PID, network (loopback only, up), IPC
# and UTS namespaces: it cannot signal or see the host's processes (a kill of every process of a
# uid stays inside), reach a network, or touch the host's devices (a /dev of null, zero, full,
# random, urandom and tty, its own pts and shm). /sys is read-only except the cgroup hierarchies,
# which the sandbox needs writable: a command can still change the host's cgroups (its own ones
# are created below the hierarchy roots and removed by the sandbox).
# Needs root with CAP_SYS_ADMIN (mount, unshare) and overlayfs in the kernel, as in a container
# that runs as root. The working directory is kept.
set -euo pipefail

keep=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --keep) keep+=("$(realpath -m "$2")"); shift 2 ;;
    --) shift; break ;;
    *) echo "throwaway_root: unknown argument $1 (usage: $0 [--keep DIR]... -- COMMAND...)" >&2; exit 2 ;;
  esac
done
[[ $# -gt 0 ]] || { echo "throwaway_root: no command (usage: $0 [--keep DIR]... -- COMMAND...)" >&2; exit 2; }
[[ $(id -u) -eq 0 ]] || { echo "throwaway_root: needs root (it mounts an overlay over /)" >&2; exit 2; }
for dir in "${keep[@]}"; do mkdir -p "$dir"; done

top=$(mktemp -d /tmp/throwaway-root.XXXXXX)
trap 'rmdir "$top" 2>/dev/null || true' EXIT

# The inner script runs in the new namespaces: mounts made there vanish with them.
inner='
set -euo pipefail
top=$1; cwd=$2; nkeep=$3; shift 3
keep=("${@:1:$nkeep}"); shift "$nkeep"
mount --make-rprivate /
mount -t tmpfs -o size=50% throwaway "$top"
mkdir "$top/upper" "$top/work" "$top/root"
mount -t overlay overlay -o "lowerdir=/,upperdir=$top/upper,workdir=$top/work" "$top/root"
r=$top/root
mount -t proc proc "$r/proc"
mount -t tmpfs -o mode=755,nosuid dev "$r/dev"
for d in null zero full random urandom tty; do touch "$r/dev/$d"; mount --bind "/dev/$d" "$r/dev/$d"; done
mkdir "$r/dev/pts" "$r/dev/shm"
mount -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts "$r/dev/pts"
ln -s pts/ptmx "$r/dev/ptmx"
mount -t tmpfs -o mode=1777,nosuid,nodev shm "$r/dev/shm"
ln -s /proc/self/fd "$r/dev/fd"
mount --rbind /sys "$r/sys"
mount -o remount,bind,ro "$r/sys"
for dir in "${keep[@]}"; do mkdir -p "$r$dir"; mount --bind "$dir" "$r$dir"; done
ip link set lo up 2>/dev/null || python3 -c "import socket,fcntl,struct
s=socket.socket(); f=fcntl.ioctl(s, 0x8913, struct.pack(\"16sh\", b\"lo\", 0))
fcntl.ioctl(s, 0x8914, struct.pack(\"16sh\", b\"lo\", struct.unpack(\"16sh\", f)[1] | 1))"
exec chroot "$r" /usr/bin/env -C "$cwd" "$@"
'
unshare --mount --pid --net --ipc --uts --fork --kill-child \
  bash -c "$inner" throwaway "$top" "$PWD" "${#keep[@]}" "${keep[@]}" "$@"
