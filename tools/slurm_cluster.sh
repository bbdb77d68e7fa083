#!/usr/bin/env bash
# A real Slurm cluster on this machine, for the tests and for trying 1.train_llama.sbatch
# before using a real cluster: one node (this machine), or SLURM_CLUSTER_NODES=N nodes, each
# a slurmd in network and UTS namespaces of its own, with its own address (10.X.Y.11, .12,
# ... on a bridge whose 10.X.Y.1 is the controller) and hostname (ip-10-X-Y-11, ...). Node
# names (node1, node2, ...) resolve nowhere and each node resolves only its own hostname, as
# on clusters whose NodeName is not a DNS name: jobs must connect by address.
#
# Everything it creates lives in one state folder (config, munge key and socket, spool,
# logs, PID files) and, with several nodes, in namespaces and links it records there, so it
# never touches /etc/slurm or a system munged, two clusters can run side by side, and
# `stop` ends exactly the daemons it started (by PID) and removes what it created.
#
#   eval "$(tools/slurm_cluster.sh start)"      # prints: export SLURM_CONF=...; ...
#   sbatch --nodes=1 1.train_llama.sbatch --preset tiny
#   tools/slurm_cluster.sh stop "$SLURM_CLUSTER_DIR" [--purge]
#
# Needs Debian's slurm-wlm and munge (tools/install_test_deps.sh) and root: slurmd must
# be root to start job steps (several nodes also need `ip netns` and `unshare`). Settings:
# SLURM_CLUSTER_NODES (default 1), SLURM_CLUSTER_CPUS (per node; default: all CPUs),
# SLURM_CLUSTER_PROCTRACK (linuxproc, default, or pgid: signals reach only the task's process
# group, as on clusters without cgroups), SLURM_CLUSTER_WAIT (seconds to wait for the nodes
# to become idle, default 60), SLURM_CLUSTER_PLUGSTACK (the lines of the cluster's
# plugstack.conf, e.g. `required /path/spank_pyxis.so ...`; default none). The daemons inherit
# this command's environment (PATH included: Pyxis finds enroot there).
set -euo pipefail

readonly MARKER=".slurm_cluster_state"

usage() {
    cat >&2 <<'EOF'
usage: slurm_cluster.sh start [STATE_DIR]   start munged + slurmctld + slurmd(s); print env exports
       slurm_cluster.sh stop STATE_DIR [--purge]   stop them by PID (--purge removes STATE_DIR)
       slurm_cluster.sh status STATE_DIR    show daemons and sinfo
       slurm_cluster.sh shape STATE_DIR NODE RATE|off   cap node NODE's sending rate (tc tbf)
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

# slurm.conf; the node lines ("NodeName=... NodeAddr=...") come on stdin.
write_config() {
    local dir=$1 ctld_addr=$2 cpus=$3 mem=$4 ctld_port=$5 slurmd_port=$6
    local line nodes=""
    while read -r line; do
        nodes+="$line CPUs=${cpus} RealMemory=${mem} State=UNKNOWN"$'\n'
    done
    # SPANK plugins: none from the system config; SLURM_CLUSTER_PLUGSTACK's lines if given
    # (tools/container_e2e.sh: Pyxis).
    printf '%s\n' "${SLURM_CLUSTER_PLUGSTACK:-}" >"$dir/plugstack.conf"
    cat >"$dir/slurm.conf" <<EOF
# Written by tools/slurm_cluster.sh: a throwaway cluster.
ClusterName=local
SlurmctldHost=$(hostname -s)(${ctld_addr})
SlurmUser=root
SlurmdUser=root
SlurmctldPort=${ctld_port}
SlurmdPort=${slurmd_port}
AuthType=auth/munge
CredType=cred/munge
# cred_expire: how long a requeued job waits before it may start again (default 120 s).
AuthInfo=socket=${dir}/munge/munge.socket,cred_expire=5
StateSaveLocation=${dir}/state
SlurmdSpoolDir=${dir}/spool/%n
SlurmctldPidFile=${dir}/slurmctld.pid
SlurmdPidFile=${dir}/slurmd-%n.pid
SlurmctldLogFile=${dir}/log/slurmctld.log
SlurmdLogFile=${dir}/log/slurmd-%n.log
PlugStackConfig=${dir}/plugstack.conf
# No cgroups in containers/CI: track job processes through /proc (or by process group).
ProctrackType=proctrack/${SLURM_CLUSTER_PROCTRACK:-linuxproc}
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
${nodes}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
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

wait_for_idle_nodes() {
    local count=$1 deadline=$((SECONDS + ${SLURM_CLUSTER_WAIT:-60})) states="" idle
    while ((SECONDS < deadline)); do
        states=$(sinfo --noheader --Node --format=%T 2>/dev/null || true)
        idle=$(grep -cx idle <<<"$states" || true)
        if ((idle == count)); then
            return 0
        fi
        sleep 0.5
    done
    die "nodes not idle after ${SLURM_CLUSTER_WAIT:-60}s (states: '${states//$'\n'/ }'); see $SLURM_CLUSTER_DIR/log"
}

# A 10.X.Y.0/24 that no route of this machine covers or overlaps.
free_subnet() {
    local routes x y try
    routes=$(ip -4 route show table all 2>/dev/null || true)
    for try in $(seq 50); do
        x=$((100 + RANDOM % 150)) y=$((RANDOM % 250))
        if ! grep -qE "(^|[^0-9])10\.($x\.$y\.|$x\.0\.0/16|0\.0\.0/8)" <<<"$routes"; then
            echo "10.$x.$y"
            return 0
        fi
    done
    die "no free 10.X.Y.0/24 subnet after $try tries"
}

# Nodes 1..N: each a slurmd in a network namespace (its address on a veth) and a UTS namespace
# (its hostname), with an /etc/hosts naming only itself. The veths meet on a bridge in a
# namespace of its own, where no firewall rule of this machine (Docker's FORWARD DROP with
# br_netfilter, say) applies; this namespace reaches it through one more veth, at 10.X.Y.1.
# Every namespace and link is recorded in $dir/netns before it exists, for `stop`.
start_namespaced_nodes() {
    local dir=$1 count=$2 subnet=$3 tag=$4 i ns host addr
    local net=slurm-$tag-net
    printf 'netns %s\nlink slv%s\n' "$net" "$tag" >>"$dir/netns"
    ip netns add "$net"
    ip -n "$net" link add br0 type bridge
    ip -n "$net" link set br0 up
    ip link add "slv$tag" type veth peer name ctl netns "$net"
    ip -n "$net" link set ctl master br0 up
    ip addr add "$subnet.1/24" dev "slv$tag"
    ip link set "slv$tag" up
    for ((i = 1; i <= count; i++)); do
        ns=slurm-$tag-node$i host=ip-${subnet//./-}-$((10 + i)) addr=$subnet.$((10 + i))
        echo "netns $ns" >>"$dir/netns"
        ip netns add "$ns"
        ip -n "$net" link add "node$i" type veth peer name eth0 netns "$ns"
        ip -n "$net" link set "node$i" master br0 up
        ip -n "$ns" addr add "$addr/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
        printf '127.0.0.1 localhost\n%s %s\n' "$addr" "$host" >"$dir/hosts-node$i"
        mkdir -p "$dir/spool/node$i"
        # A mount namespace of its own too, so the bind mount stays there.
        # shellcheck disable=SC2016  # $1.. expand in the inner shell
        nsenter --net="/run/netns/$ns" -- unshare --uts --mount -- sh -c \
            'hostname "$1" && mount --bind "$2" /etc/hosts && exec slurmd -f "$3" -N "$4"' \
            sh "$host" "$dir/hosts-node$i" "$SLURM_CONF" "node$i"
    done
}

cmd_start() {
    [[ $(id -u) -eq 0 ]] || die "must run as root (slurmd starts job steps as the submitting user)"
    local tool
    for tool in munged slurmctld slurmd sinfo python3; do
        command -v "$tool" >/dev/null || die "$tool not found: run tools/install_test_deps.sh"
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
    # A start that fails half-way stops what it started (the caller gets no state folder to stop).
    starting_dir=$dir
    trap 'if [[ -n $starting_dir ]]; then cmd_stop "$starting_dir"; fi' EXIT

    local count=${SLURM_CLUSTER_NODES:-1} cpus mem
    [[ $count =~ ^[1-9][0-9]?$ ]] || die "SLURM_CLUSTER_NODES=$count is not a number of nodes (1-99)"
    cpus=${SLURM_CLUSTER_CPUS:-$(nproc)}
    mem=$(node_memory_mb)
    export SLURM_CONF=$dir/slurm.conf SLURM_CLUSTER_DIR=$dir
    if ((count == 1)); then
        local node
        node=$(hostname -s)
        mkdir -p "$dir/spool/$node"
        echo "NodeName=$node NodeAddr=127.0.0.1" |
            write_config "$dir" 127.0.0.1 "$cpus" "$mem" "$(free_port)" "$(free_port)"
        start_munge "$dir"
        slurmctld -f "$SLURM_CONF" -c -i
        slurmd -f "$SLURM_CONF" -N "$node"
    else
        for tool in ip nsenter unshare; do
            command -v "$tool" >/dev/null || die "$tool not found (iproute2, util-linux)"
        done
        local subnet tag i
        subnet=$(free_subnet)
        tag=$(od -An -N3 -tx1 /dev/urandom | tr -d ' \n')
        for ((i = 1; i <= count; i++)); do
            echo "NodeName=node$i NodeHostname=ip-${subnet//./-}-$((10 + i)) NodeAddr=$subnet.$((10 + i))"
        done | write_config "$dir" "$subnet.1" "$cpus" "$mem" "$(free_port)" "$(free_port)"
        start_munge "$dir"
        start_namespaced_nodes "$dir" "$count" "$subnet" "$tag"
        slurmctld -f "$SLURM_CONF" -c -i
    fi
    wait_for_idle_nodes "$count"
    starting_dir=""
    echo "export SLURM_CONF=$SLURM_CONF SLURM_CLUSTER_DIR=$dir"
    echo "slurm_cluster.sh: $count node(s) idle ($cpus CPUs, ${mem} MiB each); state in $dir" >&2
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
    local pid_file kind name
    for pid_file in "$dir"/slurmd-*.pid "$dir/slurmctld.pid"; do
        stop_pid_file "$pid_file" & # all at once: each may take seconds
    done
    wait
    stop_pid_file "$dir/munged.pid"
    # A multi-node cluster's namespaces and links: only those recorded at start.
    if [[ -f $dir/netns ]]; then
        while read -r kind name; do
            case $kind in
            netns) ip netns delete "$name" 2>/dev/null || true ;;
            link) ip link delete "$name" 2>/dev/null || true ;;
            esac
        done < <(tac "$dir/netns")
        rm -f "$dir/netns"
    fi
    if [[ $purge == --purge ]]; then
        rm -rf "$dir"
    fi
}

cmd_status() {
    local dir=${1:-} name pid
    [[ -n $dir && -f $dir/$MARKER ]] || die "'$dir' is not a state folder made by slurm_cluster.sh"
    local pid_file
    for pid_file in "$dir"/munged.pid "$dir"/slurmctld.pid "$dir"/slurmd-*.pid; do
        name=$(basename "$pid_file" .pid)
        pid=$(cat "$pid_file" 2>/dev/null || true)
        if [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; then
            echo "$name running (pid $pid)"
        else
            echo "$name not running"
        fi
    done
    SLURM_CONF=$dir/slurm.conf sinfo || true
}

# A slower link without a slower machine: a token bucket (tc's tbf) on node NODE's eth0 caps
# what it sends (e.g. RATE=400mbit; `off` lifts it); what it receives keeps the bridge's speed.
cmd_shape() {
    local dir=${1:-} node=${2:-} rate=${3:-} ns
    [[ -n $dir && -f $dir/$MARKER ]] || die "'$dir' is not a state folder made by slurm_cluster.sh"
    ns=$(sed -n "s/^netns \(slurm-.*-node$node\)$/\1/p" "$dir/netns" 2>/dev/null)
    [[ -n $ns && -n $rate ]] || die "shape takes a node number and a rate (e.g. 2 400mbit) or off"
    if [[ $rate == off ]]; then
        tc -n "$ns" qdisc del dev eth0 root 2>/dev/null || true # none left: as wanted
    else
        tc -n "$ns" qdisc replace dev eth0 root tbf rate "$rate" burst 256kb latency 20ms
    fi
}

main() {
    [[ $# -ge 1 ]] || usage
    local cmd=$1
    shift
    case $cmd in
    start) cmd_start "$@" ;;
    stop) cmd_stop "$@" ;;
    status) cmd_status "$@" ;;
    shape) cmd_shape "$@" ;;
    *) usage ;;
    esac
}

main "$@"
