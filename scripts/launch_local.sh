#!/usr/bin/env bash
# Run COMMAND as N cooperating processes on this machine, the way a multi-host job behaves:
# 8/N simulated CPU devices each, jax.distributed with the coordinator on loopback, gloo
# collectives. Exits with the first non-zero status of its processes.
#
#   scripts/launch_local.sh 2 jaxpar train --config configs/tiny.py
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: scripts/launch_local.sh N COMMAND [ARGS...]" >&2
  exit 2
fi
n=$1; shift
case "$n" in ''|*[!0-9]*) echo "error: N='$n' must be a positive integer" >&2; exit 2;; esac
if [ "$n" -lt 1 ] || [ $((8 % n)) -ne 0 ]; then
  echo "error: N=$n must divide the 8 simulated devices (1, 2, 4 or 8)" >&2; exit 2
fi
port=${JAXPAR_PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
export JAXPAR_COORDINATOR="127.0.0.1:${port}" JAXPAR_NUM_PROCESSES="$n" JAX_PLATFORMS=cpu
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=$((8 / n))"
pids=()
for ((i = 0; i < n; i++)); do
  JAXPAR_PROCESS_ID=$i "$@" &
  pids+=($!)
done
# Preemption reaches every process (each checkpoints cooperatively and exits 0).
trap 'kill -TERM "${pids[@]}" 2>/dev/null || true' TERM INT
# A process that dies is not papered over: the others notice through jax.distributed's heartbeat
# and exit with an error on their own (JAXPAR_HEARTBEAT_TIMEOUT seconds); the first non-zero
# status is ours.
status=0
for p in "${pids[@]}"; do
  while true; do
    if wait "$p"; then rc=0; else rc=$?; fi
    # wait returns >128 when interrupted by a trapped signal while the child still runs
    kill -0 "$p" 2>/dev/null || break
  done
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
done
exit $status
