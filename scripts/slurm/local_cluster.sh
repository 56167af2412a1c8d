#!/usr/bin/env bash
# A SLURM cluster of N emulated nodes on this machine, for trying jaxpar's sbatch scripts (and for
# the test suite). Installs Debian's SLURM packages when they are missing (as root), writes the
# configuration into a temporary directory, starts munged, slurmctld and one slurmd per node
# (`slurmd -N nodeK`, each on its own port), waits until every node is idle, then either runs
# COMMAND with SLURM_CONF pointing at the cluster and exits with its status, or, without a command,
# prints the cluster's environment and runs until SIGTERM / SIGINT. Every daemon it started is
# stopped by pid on exit, also on failure.
#
#   scripts/slurm/local_cluster.sh 2 -- sbatch --wait --nodes=2 scripts/slurm/train.sbatch configs/tiny.py
#   scripts/slurm/local_cluster.sh --cpus 4 2          # stays up; prints "ready SLURM_CONF=..."
#
# Options: --cpus C (CPUs each node declares, default 2), --dir D (state directory, default a new
# temporary one; removed on exit only when it was created here), --timeout S (how long to wait for
# the nodes to be idle, default 60).
#
# Emulated nodes share this host: NodeAddr is 127.0.0.1, and the node names (node1 .. nodeN) need
# not resolve, since scripts/slurm/train.sbatch hands jaxpar the first node's address from
# `scontrol show node` rather than its name.
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"  # where Debian puts the daemons, missing from some users' PATH

usage() {
  echo "usage: scripts/slurm/local_cluster.sh [--cpus C] [--dir D] [--timeout S] N [-- COMMAND [ARGS...]]" >&2
  exit 2
}
cpus=2 dir="" timeout=60 nodes=""
while [ $# -gt 0 ]; do
  case "$1" in
    --cpus) cpus=${2:-}; shift 2 || usage ;;
    --dir) dir=${2:-}; shift 2 || usage ;;
    --timeout) timeout=${2:-}; shift 2 || usage ;;
    --) shift; break ;;
    -*) usage ;;
    *) [ -z "$nodes" ] || usage; nodes=$1; shift ;;
  esac
done
for v in "nodes=$nodes" "cpus=$cpus" "timeout=$timeout"; do
  case "${v#*=}" in ''|*[!0-9]*|0) echo "error: ${v%%=*}='${v#*=}' must be a positive integer" >&2; exit 2 ;; esac
done

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null \
  || ! command -v sbatch >/dev/null; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "error: SLURM is not installed and installing it needs root: apt-get install munge slurmctld slurmd slurm-client" >&2
    exit 3
  fi
  echo "local_cluster: installing munge slurmctld slurmd slurm-client" >&2
  export DEBIAN_FRONTEND=noninteractive
  # A policy that stops the packages' own services from starting: this script starts its own.
  if [ ! -e /usr/sbin/policy-rc.d ]; then printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; added_policy=1; fi
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends munge slurmctld slurmd slurm-client; } >&2 \
    || { echo "error: could not install SLURM from Debian's packages" >&2; exit 3; }
  if [ "${added_policy:-0}" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
fi

created=0
if [ -z "$dir" ]; then dir=$(mktemp -d /tmp/jaxpar-slurm.XXXXXX); created=1; fi
mkdir -p "$dir/state" "$dir/log"
chmod 700 "$dir"
pids=()
cleanup() {
  local status=$?
  trap - EXIT INT TERM
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for _ in $(seq 50); do
    alive=0
    for p in "${pids[@]}"; do if kill -0 "$p" 2>/dev/null; then alive=1; fi; done
    [ $alive = 0 ] && break
    sleep 0.1
  done
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  # Job steps the slurmds started (slurmstepd and their tasks) go with them.
  pkill -KILL -f "slurmstepd.*$dir" 2>/dev/null || true
  if [ $created = 1 ]; then rm -rf "$dir"; fi
  exit $status
}
trap cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
host=$(hostname -s)
user=$(id -un)
ctld_port=$(free_port)

# munge: its own key, socket and daemon, so nothing of the host's munge is touched.
dd if=/dev/urandom of="$dir/munge.key" bs=1024 count=1 status=none
chmod 400 "$dir/munge.key"
munged --force --socket="$dir/munge.socket" --key-file="$dir/munge.key" --pid-file="$dir/munged.pid" \
  --log-file="$dir/log/munged.log" --seed-file="$dir/munge.seed" -F >"$dir/log/munged.out" 2>&1 &
pids+=($!)

{
  echo "ClusterName=jaxpar-local"
  echo "SlurmctldHost=$host(127.0.0.1)"
  echo "SlurmctldPort=$ctld_port"
  echo "AuthType=auth/munge"
  echo "AuthInfo=socket=$dir/munge.socket"
  echo "CredType=cred/munge"
  echo "SlurmUser=$user"
  echo "SlurmdUser=$user"
  echo "StateSaveLocation=$dir/state"
  echo "SlurmdSpoolDir=$dir/spool-%n"
  echo "SlurmctldPidFile=$dir/slurmctld.pid"
  echo "SlurmdPidFile=$dir/slurmd-%n.pid"
  echo "SlurmctldLogFile=$dir/log/slurmctld.log"
  echo "SlurmdLogFile=$dir/log/slurmd-%n.log"
  echo "ProctrackType=proctrack/linuxproc"
  echo "TaskPlugin=task/none"
  echo "JobAcctGatherType=jobacct_gather/none"
  echo "AccountingStorageType=accounting_storage/none"
  echo "SchedulerType=sched/builtin"
  echo "SelectType=select/cons_tres"
  echo "SelectTypeParameters=CR_CPU"
  echo "SlurmdParameters=config_overrides"   # nodes declare --cpus, whatever this host has
  echo "MpiDefault=none"
  echo "ReturnToService=2"
  echo "KillWait=3"                           # SIGTERM to SIGKILL when a job ends or is cancelled
  echo "EnforcePartLimits=ALL"                # a job larger than the cluster is refused at submission, not queued
  echo "MinJobAge=300"
  echo "InactiveLimit=0"
  echo "SlurmctldTimeout=30"
  echo "SlurmdTimeout=30"
  for ((i = 1; i <= nodes; i++)); do
    echo "NodeName=node$i NodeHostname=$host NodeAddr=127.0.0.1 Port=$(free_port) CPUs=$cpus RealMemory=1024 State=UNKNOWN"
  done
  echo "PartitionName=local Nodes=ALL Default=YES MaxTime=60 State=UP OverSubscribe=NO"
} >"$dir/slurm.conf"
export SLURM_CONF="$dir/slurm.conf"

for _ in $(seq 50); do [ -S "$dir/munge.socket" ] && break; sleep 0.1; done
[ -S "$dir/munge.socket" ] || { echo "error: munged did not start; see $dir/log/munged.log" >&2; exit 1; }
slurmctld -D -i -f "$SLURM_CONF" >"$dir/log/slurmctld.out" 2>&1 &
pids+=($!)
for ((i = 1; i <= nodes; i++)); do
  mkdir -p "$dir/spool-node$i"
  slurmd -D -N "node$i" -f "$SLURM_CONF" >"$dir/log/slurmd-node$i.out" 2>&1 &
  pids+=($!)
done

deadline=$((SECONDS + timeout))
while true; do
  idle=$(sinfo -h -N -o '%N %T' 2>/dev/null | awk '$2 == "idle"' | wc -l || true)
  [ "$idle" -ge "$nodes" ] && break
  for p in "${pids[@]}"; do
    kill -0 "$p" 2>/dev/null || { echo "error: a SLURM daemon exited; logs in $dir/log" >&2; tail -5 "$dir"/log/*.log >&2 || true; exit 1; }
  done
  if [ $SECONDS -ge $deadline ]; then
    echo "error: $idle of $nodes nodes idle after ${timeout}s; logs in $dir/log" >&2
    sinfo -N >&2 || true
    exit 1
  fi
  sleep 0.2
done

if [ $# -gt 0 ]; then
  set +e
  "$@"
  exit $?
fi
echo "ready SLURM_CONF=$SLURM_CONF nodes=$nodes cpus=$cpus"
while true; do sleep 1 & wait $! || true; done
