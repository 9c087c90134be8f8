#!/usr/bin/env bash
# A real Slurm cluster on this machine (Debian's slurmctld/slurmd/munge, run as root without
# systemd), for trying the sbatch templates and for the test suite: one node, or several
# "nodes" that are network namespaces of this machine.
#
#   slurm/local_cluster.sh start [--nodes N]   start munged, slurmctld and the slurmd(s)
#                                              (idempotent); prints the 'export SLURM_CONF=...'
#                                              line to use with srun/sbatch
#   slurm/local_cluster.sh stop [--nodes N]    stop what start started, and remove the namespaces
#   slurm/local_cluster.sh status [--nodes N]
#   slurm/local_cluster.sh exec NODE CMD...    run CMD on a node of a multi-node cluster (its
#                                              network, hostname and mounts), in this directory
#                                              with this environment, as srun would; there
#                                              `ssh` reaches every node (slurm/node_ssh/ssh: the
#                                              nodes run no sshd), so mpirun -hostfile and
#                                              horovodrun -H work from it
#
# One node (the default): this host, claiming 8 CPUs (config_overrides) so that 4 tasks fit on
# a 2-core machine. State in $TOOLKIT_SLURM_DIR (default /tmp/hpc-toolkit-slurm).
#
# N > 1 nodes: node1..nodeN, each a network namespace (toolkit-node<i>) with its own hostname
# (a UTS namespace), its own address 10.77.0.1<i> on a bridge (tkbr0, the host 10.77.0.1), its
# own /etc/hosts naming every node, its own node-local directory (Slurm's TmpFS,
# $DIR/nodetmp, a different folder per node: PMIx's files, staged data) and a slurmd; the
# filesystem is otherwise shared, as a cluster's shared storage is. Each node claims 4 CPUs.
# The link between nodes is shaped to $TOOLKIT_INTERNODE_RATE (tc tbf, default 1gbit, about
# 1/25 of what loopback moves here, the ratio of NVLink-class to OPA-class links); latency is
# not shaped (this kernel has no netem). State in $TOOLKIT_SLURM_DIR (default
# /tmp/hpc-toolkit-slurm-<N>nodes), ports 16837/16838.
set -euo pipefail

NODES=1
ACTION=${1:-}
shift || true
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# A node's slurmd was started inside the node's namespaces: entering its namespaces is being on
# the node.
if [ "$ACTION" = exec ]; then
  NODE=${1:-}
  [ $# -ge 2 ] || { echo "local_cluster.sh: usage: $0 exec NODE CMD..." >&2; exit 2; }
  shift
  PID=""
  case "$NODE" in node*[!0-9]*|node) ;; node*) PID=$(pgrep -xf "slurmd -N $NODE -f .*" | head -n 1 || true) ;; esac
  if [ -z "$PID" ]; then
    echo "local_cluster.sh: exec $NODE: no such node is running (no 'slurmd -N $NODE')" >&2
    echo "HINT: the nodes of 'local_cluster.sh start --nodes N' are node1..nodeN" >&2
    exit 2
  fi
  exec nsenter --target "$PID" --net --uts --mount --wd="$PWD" \
    env PATH="$SCRIPT_DIR/node_ssh:$PATH" "$@"
fi

while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) NODES=$2; shift 2 ;;
    --nodes=*) NODES=${1#--nodes=}; shift ;;
    *) echo "local_cluster.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
case "$NODES" in ''|*[!0-9]*|0) echo "local_cluster.sh: --nodes $NODES: give a positive count" >&2; exit 2 ;; esac

if [ "$NODES" = 1 ]; then
  DIR=${TOOLKIT_SLURM_DIR:-/tmp/hpc-toolkit-slurm}
  CTLD_PORT=${TOOLKIT_SLURMCTLD_PORT:-16817}
  SLURMD_PORT=${TOOLKIT_SLURMD_PORT:-16818}
else
  DIR=${TOOLKIT_SLURM_DIR:-/tmp/hpc-toolkit-slurm-${NODES}nodes}
  CTLD_PORT=${TOOLKIT_SLURMCTLD_PORT:-16837}
  SLURMD_PORT=${TOOLKIT_SLURMD_PORT:-16838}
fi
CONF=$DIR/slurm.conf
HOST=$(hostname -s)
NET=10.77.0
BRIDGE=tkbr0
RATE=${TOOLKIT_INTERNODE_RATE:-1gbit}

die() { echo "local_cluster.sh: $*" >&2; exit 1; }
node_names() { seq -f 'node%g' 1 "$NODES"; }

write_conf() {
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log"
  local nodes ctld tmpfs=""
  if [ "$NODES" = 1 ]; then
    ctld=$HOST
    nodes="NodeName=$HOST CPUs=8 State=UNKNOWN"
    partition=$HOST
  else
    ctld="$HOST($NET.1)"
    nodes=$(for i in $(seq 1 "$NODES"); do
      echo "NodeName=node$i NodeAddr=$NET.1$i NodeHostname=node$i CPUs=4 State=UNKNOWN"; done)
    partition=$(node_names | paste -sd, -)
    tmpfs="TmpFS=$DIR/nodetmp"
  fi
  cat > "$CONF" <<CONF
ClusterName=toolkit$([ "$NODES" = 1 ] || echo "-${NODES}nodes")
SlurmctldHost=$ctld
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
MpiParams=ports=$([ "$NODES" = 1 ] && echo 12000-12999 || echo 13000-13999)
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
JobRequeue=1
KillWait=5
MinJobAge=300
InactiveLimit=0
$tmpfs
$nodes
PartitionName=debug Nodes=$partition Default=YES MaxTime=INFINITE State=UP
CONF
}

running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start_munge() {
  if ! munge -n >/dev/null 2>&1 </dev/null; then
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge /etc/munge/munge.key 2>/dev/null || true
    if command -v runuser >/dev/null; then runuser -u munge -- munged; else munged --force; fi
    echo started > "$DIR/munged.started"
  fi
}

# The namespaces, the bridge and the shaped links (idempotent).
make_network() {
  command -v ip >/dev/null || die "ip (iproute2) not found"
  ip link show "$BRIDGE" >/dev/null 2>&1 || {
    ip link add "$BRIDGE" type bridge
    ip addr add "$NET.1/24" dev "$BRIDGE"
  }
  ip link set "$BRIDGE" up
  { grep -v ' node[0-9]*$' /etc/hosts; for i in $(seq 1 "$NODES"); do echo "$NET.1$i node$i"; done
  } > "$DIR/hosts"
  mkdir -p "$DIR/nodetmp"
  for i in $(seq 1 "$NODES"); do
    local ns=toolkit-node$i
    mkdir -p "$DIR/local/node$i" "$DIR/spool/node$i"
    if ! ip netns list | grep -qx "$ns\( (id: [0-9]*)\)\?"; then
      ip netns add "$ns"
      ip link del "tkv$i" 2>/dev/null || true  # one a crashed run left behind
      ip link add "tkv$i" type veth peer name eth0 netns "$ns"
      ip link set "tkv$i" master "$BRIDGE"
      ip link set "tkv$i" up
      ip -n "$ns" addr add "$NET.1$i/24" dev eth0
      ip -n "$ns" link set eth0 up
      ip -n "$ns" link set lo up
      # each direction of the node's link: to the node (the bridge's port), from it (eth0)
      tc qdisc replace dev "tkv$i" root tbf rate "$RATE" burst 512kb latency 100ms
      tc -n "$ns" qdisc replace dev eth0 root tbf rate "$RATE" burst 512kb latency 100ms
    fi
  done
}

start_slurmds() {
  if [ "$NODES" = 1 ]; then
    mkdir -p "$DIR/spool/$HOST"
    running "$DIR/slurmd.$HOST.pid" || slurmd -f "$CONF"
    return
  fi
  for i in $(seq 1 "$NODES"); do
    running "$DIR/slurmd.node$i.pid" && continue
    # a node: its network, hostname and mounts (its /etc/hosts, its node-local directory)
    nsenter --net="/run/netns/toolkit-node$i" unshare --uts --mount --propagation private \
      sh -c "mount --bind '$DIR/hosts' /etc/hosts && mount --bind '$DIR/local/node$i' '$DIR/nodetmp' && hostname node$i && exec slurmd -N node$i -f '$CONF'"
  done
}

start() {
  for tool in munged slurmctld slurmd sinfo; do
    command -v "$tool" >/dev/null || die "$tool not found. HINT: run 'tools/install.sh --slurm'"
  done
  write_conf
  export SLURM_CONF=$CONF
  start_munge
  [ "$NODES" = 1 ] || make_network
  # A new cluster starts empty (-c): jobs of one stopped or crashed earlier hold no CPUs.
  running "$DIR/slurmctld.pid" || slurmctld -c -f "$CONF"
  start_slurmds
  for _ in $(seq 1 60); do
    states=$(sinfo -h -N -o '%t' 2>/dev/null || true)
    up=$(echo "$states" | grep -c '^\(idle\|mix\|alloc\)' || true)
    if [ "$up" = "$NODES" ]; then echo "export SLURM_CONF=$CONF"; return 0; fi
    if echo "$states" | grep -q '^\(drain\|inval\|down\)'; then
      scontrol update nodename="$(sinfo -h -o '%N' | head -n 1)" state=resume >/dev/null 2>&1 || true
    fi
    sleep 0.5
  done
  die "the nodes did not come up (states: $(echo ${states:-none})); see $DIR/log/"
}

stop() {
  for pid in "$DIR"/slurmd.*.pid "$DIR/slurmctld.pid"; do
    if running "$pid"; then kill "$(cat "$pid")"; fi
  done
  if [ "$NODES" != 1 ]; then
    for i in $(seq 1 "$NODES"); do
      local ns=toolkit-node$i
      ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
      # (the kernel frees a namespace's links lazily: a quick restart would meet them)
      ip link del "tkv$i" 2>/dev/null || true
      ip netns del "$ns" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
  fi
  if [ -f "$DIR/munged.started" ]; then
    pkill -x munged 2>/dev/null || true
    rm -f "$DIR/munged.started"
  fi
  for _ in $(seq 1 40); do
    alive=0
    for pid in "$DIR"/slurmd.*.pid "$DIR/slurmctld.pid"; do running "$pid" && alive=1; done
    [ "$alive" = 0 ] && return 0
    sleep 0.25
  done
}

case "$ACTION" in
  start) start ;;
  stop) stop ;;
  status) SLURM_CONF=$CONF sinfo -N ;;
  *) die "usage: $0 start|stop|status [--nodes N], or $0 exec NODE CMD..." ;;
esac
