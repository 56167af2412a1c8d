#!/usr/bin/env bash
# Run COMMAND as N cooperating processes on this machine, the way a multi-host job behaves:
# jax.distributed with the coordinator on loopback, gloo collectives. `jaxpar train` gives each
# process its share of the mesh's simulated CPU devices (mesh devices / N; jaxpar/distributed.py),
# so XLA_FLAGS must not set a device count. Exits with the first non-zero status of its processes.
#
#   scripts/launch_local.sh 2 jaxpar train --config configs/tiny.py
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: scripts/launch_local.sh N COMMAND [ARGS...]" >&2
  exit 2
fi
n=$1; shift
case "$n" in ''|*[!0-9]*) echo "error: N='$n' must be a positive integer" >&2; exit 2;; esac
if [ "$n" -lt 1 ]; then
  echo "error: N=$n must be at least 1" >&2; exit 2
fi
port=${JAXPAR_PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
export JAXPAR_COORDINATOR="127.0.0.1:${port}" JAXPAR_NUM_PROCESSES="$n" JAX_PLATFORMS=cpu
# Each process gets SIGKILL from the kernel when this script dies, even by a SIGKILL no trap sees
# (Linux PR_SET_PDEATHSIG, kept across exec); one whose launcher is already gone exits at once.
# Elsewhere (no prctl) the command runs as is.
die_with_launcher='import ctypes, os, sys
try:
    ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)
os.execvp(sys.argv[2], sys.argv[2:])'
pids=()
for ((i = 0; i < n; i++)); do
  JAXPAR_PROCESS_ID=$i python3 -c "$die_with_launcher" $$ "$@" &
  pids+=($!)
done
# SIGTERM or SIGINT of this script reaches every process as SIGTERM (each checkpoints cooperatively
# and exits); what is left after JAXPAR_STOP_TIMEOUT seconds (default 30) gets SIGKILL, then the
# script says what it stopped in one line and exits 143 (SIGTERM) or 130 (SIGINT).
stopping=""
trap 'stopping=TERM; kill -TERM "${pids[@]}" 2>/dev/null || true' TERM
trap 'stopping=INT; kill -TERM "${pids[@]}" 2>/dev/null || true' INT
# A process that dies is not papered over: the others notice through jax.distributed's heartbeat
# and exit with an error on their own (JAXPAR_HEARTBEAT_TIMEOUT seconds); the first non-zero
# status is ours.
status=0
for p in "${pids[@]}"; do
  while [ -z "$stopping" ]; do
    if wait "$p"; then rc=0; else rc=$?; fi
    # wait returns >128 when interrupted by a trapped signal while the child still runs
    kill -0 "$p" 2>/dev/null || break
  done
  [ -n "$stopping" ] && break
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
done
if [ -n "$stopping" ]; then
  deadline=$((SECONDS + ${JAXPAR_STOP_TIMEOUT:-30}))
  while [ "$SECONDS" -lt "$deadline" ]; do
    running=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && running=1; done
    [ "$running" -eq 0 ] && break
    sleep 0.2
  done
  kill -KILL "${pids[@]}" 2>/dev/null || true
  wait 2>/dev/null || true
  echo "launch_local.sh: SIG$stopping: stopped $n processes (pids ${pids[*]})" >&2
  [ "$stopping" = TERM ] && exit 143
  exit 130
fi
exit $status
