#!/usr/bin/env bash
# Start a one-node Slurm cluster on this machine (munged, slurmctld, slurmd) for the Slurm tests.
# Idempotent: installs Debian's packages when missing, writes /etc/slurm/slurm.conf for this host
# (CPUs from nproc), starts the daemons that are not running and waits until the node is idle.
# Exit 0 when `sinfo` shows the node idle; non-zero (with the reason) otherwise.
set -euo pipefail

log() { echo "[slurm_up] $*" >&2; }

install_packages() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
    && command -v sbatch >/dev/null && return 0
  [ "$(id -u)" = 0 ] || { log "not root: cannot apt-get install slurm"; exit 3; }
  log "installing slurmctld slurmd slurm-client munge"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
}

write_config() {
  local host cpus mem
  host=$(hostname -s)
  cpus=$(nproc)
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
  mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge
  cat > /etc/slurm/slurm.conf <<CONF
ClusterName=trainwright
SlurmctldHost=${host}
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ReturnToService=2
JobRequeue=1
MpiDefault=none
KillWait=10
InactiveLimit=0
MinJobAge=300
NodeName=${host} CPUs=${cpus} RealMemory=${mem} State=UNKNOWN
PartitionName=debug Nodes=${host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
}

start_munge() {
  pgrep -x munged >/dev/null && return 0
  if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
  chmod 0400 /etc/munge/munge.key
  su -s /bin/sh munge -c "/usr/sbin/munged" 2>/dev/null || /usr/sbin/munged --force
}

# A controller that is not running left its state behind when it was killed (a machine image
# taken mid-job, a session ended mid-test): its jobs would come back as running on a node that
# runs nothing and hold every CPU until their time limit. This cluster only serves the tests, so
# a controller started here starts empty (-c), and so does the node daemon.
start_daemons() {
  if ! pgrep -x slurmctld >/dev/null; then
    log "starting slurmctld with a clean state (-c)"
    slurmctld -c
  fi
  pgrep -x slurmd >/dev/null || slurmd -c
}

wait_idle() {
  local host state
  host=$(hostname -s)
  for _ in $(seq 1 60); do
    state=$(sinfo -h -n "$host" -o %T 2>/dev/null || true)
    case "$state" in
      idle*|mixed*|allocated*) log "node $host is $state"; return 0 ;;
      down*|drain*) scontrol update NodeName="$host" State=RESUME 2>/dev/null || true ;;
    esac
    sleep 1
  done
  log "node $host did not become idle (state: ${state:-unknown}); see /var/log/slurm/"
  tail -n 20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
  return 4
}

install_packages
write_config
start_munge
start_daemons
wait_idle
