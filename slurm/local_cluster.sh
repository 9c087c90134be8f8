#!/usr/bin/env bash
# A real one-node Slurm cluster on this machine (Debian's slurmctld/slurmd/munge, run as root
# without systemd), for trying the sbatch templates and for the test suite.
#
#   slurm/local_cluster.sh start    start munged, slurmctld and slurmd (idempotent); prints the
#                                   'export SLURM_CONF=...' line to use with srun/sbatch
#   slurm/local_cluster.sh stop     stop what start started
#   slurm/local_cluster.sh status
#
# State lives in $TOOLKIT_SLURM_DIR (default /tmp/hpc-toolkit-slurm). The node claims 8 CPUs
# (config_overrides) so that 4 tasks fit on a 2-core machine.
set -euo pipefail
DIR=${TOOLKIT_SLURM_DIR:-/tmp/hpc-toolkit-slurm}
CONF=$DIR/slurm.conf
HOST=$(hostname -s)
CTLD_PORT=${TOOLKIT_SLURMCTLD_PORT:-16817}
SLURMD_PORT=${TOOLKIT_SLURMD_PORT:-16818}

die() { echo "local_cluster.sh: $*" >&2; exit 1; }

write_conf() {
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log"
  cat > "$CONF" <<CONF
ClusterName=toolkit
SlurmctldHost=$HOST
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
MpiParams=ports=12000-12999
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
JobRequeue=1
KillWait=5
MinJobAge=300
InactiveLimit=0
NodeName=$HOST CPUs=8 State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
CONF
}

running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
  for tool in munged slurmctld slurmd sinfo; do
    command -v "$tool" >/dev/null || die "$tool not found. HINT: run 'tools/install.sh --slurm'"
  done
  write_conf
  export SLURM_CONF=$CONF
  if ! munge -n >/dev/null 2>&1 </dev/null; then
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge /etc/munge/munge.key 2>/dev/null || true
    if command -v runuser >/dev/null; then runuser -u munge -- munged; else munged --force; fi
    echo started > "$DIR/munged.started"
  fi
  running "$DIR/slurmctld.pid" || slurmctld -f "$CONF"
  running "$DIR/slurmd.pid" || slurmd -f "$CONF"
  for _ in $(seq 1 60); do
    state=$(sinfo -h -N -o '%t' 2>/dev/null | head -n 1 || true)
    case "$state" in
      idle*|mix*|alloc*) echo "export SLURM_CONF=$CONF"; return 0 ;;
      drain*|inval*|down*) scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true ;;
    esac
    sleep 0.5
  done
  die "the node did not come up (state '${state:-none}'); see $DIR/log/"
}

stop() {
  for d in slurmd slurmctld; do
    if running "$DIR/$d.pid"; then kill "$(cat "$DIR/$d.pid")"; fi
  done
  if [ -f "$DIR/munged.started" ]; then
    pkill -x munged 2>/dev/null || true
    rm -f "$DIR/munged.started"
  fi
  for _ in $(seq 1 40); do
    running "$DIR/slurmd.pid" || running "$DIR/slurmctld.pid" || return 0
    sleep 0.25
  done
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) SLURM_CONF=$CONF sinfo -N ;;
  *) die "usage: $0 start|stop|status" ;;
esac
