#!/usr/bin/env bash
# A real single-node Slurm cluster on this machine, for the tests and for trying
# 1.train_llama.sbatch before using a real cluster.
#
# Everything it creates lives in one state folder (config, munge key and socket, spool,
# logs, PID files), so it never touches /etc/slurm or a system munged, two clusters can
# run side by side, and `stop` ends exactly the daemons it started (by PID).
#
#   eval "$(scripts/slurm_cluster.sh start)"      # prints: export SLURM_CONF=...; ...
#   sbatch --nodes=1 1.train_llama.sbatch --preset tiny
#   scripts/slurm_cluster.sh stop "$SLURM_CLUSTER_DIR" [--purge]
#
# Needs Debian's slurm-wlm and munge (scripts/install_test_deps.sh) and root: slurmd must
# be root to start job steps. Settings: SLURM_CLUSTER_CPUS (default: all CPUs),
# SLURM_CLUSTER_WAIT (seconds to wait for the node to become idle, default 60).
set -euo pipefail

readonly MARKER=".slurm_cluster_state"

usage() {
    cat >&2 <<'EOF'
usage: slurm_cluster.sh start [STATE_DIR]   start munged + slurmctld + slurmd; print env exports
       slurm_cluster.sh stop STATE_DIR [--purge]   stop them by PID (--purge removes STATE_DIR)
       slurm_cluster.sh status STATE_DIR    show daemons and sinfo
EOF
    exit 2
}

die() {
    echo "slurm_cluster.sh: $*" >&2
    exit 1
}

# A TCP port nobody listens on now. Slurm needs two fixed ports in its config; picking
# free ones lets this cluster coexist with another (or with a system Slurm).
free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# The node's memory in MiB as slurmd itself measures it, so the config always matches.
node_memory_mb() {
    slurmd -C | tr ' ' '\n' | sed -n 's/^RealMemory=//p'
}

write_config() {
    local dir=$1 node=$2 cpus=$3 mem=$4 ctld_port=$5 slurmd_port=$6
    : >"$dir/plugstack.conf" # no SPANK plugins from the system config
    cat >"$dir/slurm.conf" <<EOF
# Written by scripts/slurm_cluster.sh: a throwaway single-node cluster.
ClusterName=local
SlurmctldHost=${node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=${ctld_port}
SlurmdPort=${slurmd_port}
AuthType=auth/munge
CredType=cred/munge
# cred_expire: how long a requeued job waits before it may start again (default 120 s).
AuthInfo=socket=${dir}/munge/munge.socket,cred_expire=5
StateSaveLocation=${dir}/state
SlurmdSpoolDir=${dir}/spool
SlurmctldPidFile=${dir}/slurmctld.pid
SlurmdPidFile=${dir}/slurmd.pid
SlurmctldLogFile=${dir}/log/slurmctld.log
SlurmdLogFile=${dir}/log/slurmd.log
PlugStackConfig=${dir}/plugstack.conf
# No cgroups in containers/CI: track job processes through /proc instead.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
# Look at pending jobs every 2 s (default 60 s): a requeued job restarts promptly.
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
# Requeued jobs may start again at once (the default holds them for a while).
JobRequeue=1
MinJobAge=300
KillWait=30
NodeName=${node} NodeAddr=127.0.0.1 CPUs=${cpus} RealMemory=${mem} State=UNKNOWN
PartitionName=debug Nodes=${node} Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munge() {
    local dir=$1
    mkdir -p "$dir/munge"
    chmod 0755 "$dir/munge" # munged wants the socket folder world-executable
    # A fresh key for this cluster only: nothing else can authenticate to it.
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
    chmod 0400 "$dir/munge/munge.key"
    munged --force \
        --socket="$dir/munge/munge.socket" \
        --key-file="$dir/munge/munge.key" \
        --pid-file="$dir/munged.pid" \
        --log-file="$dir/log/munged.log" \
        --seed-file="$dir/munge/munged.seed"
}

wait_for_idle_node() {
    local node=$1 deadline=$((SECONDS + ${SLURM_CLUSTER_WAIT:-60})) state=""
    while ((SECONDS < deadline)); do
        state=$(sinfo --noheader --nodes="$node" --format=%T 2>/dev/null || true)
        if [[ $state == idle ]]; then
            return 0
        fi
        sleep 0.5
    done
    die "node $node not idle after ${SLURM_CLUSTER_WAIT:-60}s (state: '${state}'); see $SLURM_CLUSTER_DIR/log"
}

cmd_start() {
    [[ $(id -u) -eq 0 ]] || die "must run as root (slurmd starts job steps as the submitting user)"
    local tool
    for tool in munged slurmctld slurmd sinfo python3; do
        command -v "$tool" >/dev/null || die "$tool not found: run scripts/install_test_deps.sh"
    done
    local dir=${1:-}
    if [[ -z $dir ]]; then
        dir=$(mktemp -d "${TMPDIR:-/tmp}/slurm-cluster.XXXXXX")
    fi
    mkdir -p "$dir"/{state,spool,log}
    chmod 0755 "$dir" # other users read slurm.conf and reach the munge socket
    dir=$(cd "$dir" && pwd)
    [[ ! -e $dir/slurmctld.pid ]] || die "$dir already holds a cluster (stop it first)"
    touch "$dir/$MARKER"

    local node cpus mem
    node=$(hostname -s)
    cpus=${SLURM_CLUSTER_CPUS:-$(nproc)}
    mem=$(node_memory_mb)
    write_config "$dir" "$node" "$cpus" "$mem" "$(free_port)" "$(free_port)"

    export SLURM_CONF=$dir/slurm.conf SLURM_CLUSTER_DIR=$dir
    start_munge "$dir"
    slurmctld -f "$SLURM_CONF" -c -i
    slurmd -f "$SLURM_CONF" -N "$node"
    wait_for_idle_node "$node"
    echo "export SLURM_CONF=$SLURM_CONF SLURM_CLUSTER_DIR=$dir"
    echo "slurm_cluster.sh: node $node idle ($cpus CPUs, ${mem} MiB); state in $dir" >&2
}

# End one daemon by the PID its own PID file holds: TERM, then KILL after 10 s.
stop_pid_file() {
    local pid_file=$1 pid i
    [[ -s $pid_file ]] || return 0
    pid=$(<"$pid_file")
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null || true
        for ((i = 0; i < 100; i++)); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        if kill -0 "$pid" 2>/dev/null; then
            kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    rm -f "$pid_file"
}

cmd_stop() {
    local dir=${1:-} purge=${2:-}
    [[ -n $dir && -f $dir/$MARKER ]] || die "'$dir' is not a state folder made by slurm_cluster.sh"
    # Jobs first, so their steps do not outlive the daemons that track them.
    if [[ -s $dir/slurmctld.pid ]]; then
        SLURM_CONF=$dir/slurm.conf scancel --full --quiet --user=root 2>/dev/null || true
    fi
    stop_pid_file "$dir/slurmd.pid"
    stop_pid_file "$dir/slurmctld.pid"
    stop_pid_file "$dir/munged.pid"
    if [[ $purge == --purge ]]; then
        rm -rf "$dir"
    fi
}

cmd_status() {
    local dir=${1:-} name pid
    [[ -n $dir && -f $dir/$MARKER ]] || die "'$dir' is not a state folder made by slurm_cluster.sh"
    for name in munged slurmctld slurmd; do
        pid=$(cat "$dir/$name.pid" 2>/dev/null || true)
        if [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; then
            echo "$name running (pid $pid)"
        else
            echo "$name not running"
        fi
    done
    SLURM_CONF=$dir/slurm.conf sinfo || true
}

main() {
    [[ $# -ge 1 ]] || usage
    local cmd=$1
    shift
    case $cmd in
    start) cmd_start "$@" ;;
    stop) cmd_stop "$@" ;;
    status) cmd_status "$@" ;;
    *) usage ;;
    esac
}

main "$@"
