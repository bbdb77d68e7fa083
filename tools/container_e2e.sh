#!/usr/bin/env bash
# The container path of the recipe, executed on this machine: 0.transformer-engine.dockerfile ->
# Docker image -> `enroot import` squash file -> Pyxis `srun --container-image` on a two-node
# Slurm cluster (tools/slurm_cluster.sh) -> `sbatch 1.train_llama.sbatch`. For machines that
# cannot pull NVIDIA's NGC image (CI, the tests): the Dockerfile is built unchanged except its
# BASE_IMAGE, on a stand-in (tests/container/standin-base.dockerfile: Debian's Python, the pinned
# CPU torch, the TE test double as the `transformer_engine` distribution, an NGC-like pip
# constraint file), so its own RUN steps, pins and checks run for real.
#
#   tools/container_e2e.sh build STATE_DIR         # enroot + Pyxis, images, STATE_DIR/*.sqsh
#   eval "$(tools/container_e2e.sh start STATE_DIR)"   # two nodes with Pyxis; prints exports
#   IMAGE=STATE_DIR/transformer-engine.sqsh NPROC_PER_NODE=1 \
#       sbatch --nodes=2 1.train_llama.sbatch --preset tiny --max_steps 20
#   tools/container_e2e.sh stop STATE_DIR [--purge]   # cluster, daemon, mounts; --purge: folder
#
# Needs root, the Debian packages tools/install_test_deps.sh installs (check_prerequisites names
# them), and enroot's and Pyxis's source tarballs in CONTAINER_SOURCES (default
# ../shared/container next to the repository).
#
# Everything lives in STATE_DIR: enroot and Pyxis built from source (prefix/), a tmpfs for
# enroot's temporary, data and runtime folders (enroot/: unpacking on a disk is minutes, and
# each node's container is unpacked there), the squash file, the cluster (slurm/). A Docker
# daemon runs only during `build`, on its own socket, with no networking of its own (builds use
# the host's network) and leaves no iptables rule. `stop` ends what `start` and `build` began.
# Kept between runs in CONTAINER_CACHE (default ~/.cache/llama-fp8-container), under a lock:
# the Debian root file system (mmdebstrap), the torch wheel, and the Docker data root whose
# layer cache builds a step of the stand-in or the recipe's image again only if its inputs changed.
#
# Settings: CONTAINER_SOURCES, CONTAINER_CACHE, CONTAINER_TMPFS_SIZE (default 12g),
# CONTAINER_SUITE (Debian suite of the stand-in, default bookworm), and the SLURM_CLUSTER_*
# settings of tools/slurm_cluster.sh (start: SLURM_CLUSTER_NODES defaults to 2).
set -euo pipefail

readonly ENROOT_TARBALL=enroot-4.1.2.tar.gz PYXIS_TARBALL=pyxis-0.24.0.tar.gz
readonly MARKER=.container_e2e_state
readonly IMAGE_TAG=transformer-engine:latest
# What the stand-in's Debian needs: NGC's python/pip layout, and CA certificates.
readonly DEBIAN_PACKAGES=python3,python3-pip,python-is-python3,ca-certificates

repo_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
readonly repo_dir

usage() {
    cat >&2 <<'EOF'
usage: container_e2e.sh build STATE_DIR         build enroot + Pyxis, the images and the squash file
       container_e2e.sh start STATE_DIR         start a Slurm cluster with Pyxis; print env exports
       container_e2e.sh stop STATE_DIR [--purge]   stop it, unmount, (--purge: remove STATE_DIR)
EOF
    exit 2
}

die_usage() {
    echo "container_e2e.sh: $*" >&2
    exit 2
}

die() {
    echo "container_e2e.sh: $*" >&2
    exit 1
}

note() {
    echo "[container_e2e.sh $(date '+%H:%M:%S')] $*" >&2
}

# A phase and its wall time, for the log.
phase() {
    local name=$1 start=$SECONDS
    shift
    note "$name ..."
    "$@"
    note "$name: $((SECONDS - start)) s"
}

sources_dir() {
    local dir=${CONTAINER_SOURCES:-$repo_dir/../shared/container}
    [[ -f $dir/$ENROOT_TARBALL && -f $dir/$PYXIS_TARBALL ]] ||
        die_usage "no $ENROOT_TARBALL and $PYXIS_TARBALL in $dir (set CONTAINER_SOURCES)"
    cd "$dir" && pwd
}

cache_dir() {
    local dir=${CONTAINER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llama-fp8-container}
    mkdir -p "$dir"
    cd "$dir" && pwd
}

check_prerequisites() {
    [[ $(id -u) -eq 0 ]] || die_usage "must run as root (dockerd, mounts, slurmd)"
    local tool
    for tool in dockerd containerd mmdebstrap mksquashfs unsquashfs make gcc makeself jq \
        parallel zstd pigz slurmd munged flock python3; do
        command -v "$tool" >/dev/null ||
            die_usage "$tool not found: run tools/install_test_deps.sh"
    done
    [[ -f /usr/include/slurm/spank.h && -f /usr/include/bsd/string.h ]] ||
        die_usage "libslurm-dev or libbsd-dev missing: run tools/install_test_deps.sh"
}

# The state folder: created if need be, and marked as ours (so stop --purge never removes a
# folder this script did not make).
state_dir() {
    local dir=${1:-}
    [[ -n $dir ]] || usage
    if [[ -e $dir && ! -f $dir/$MARKER ]]; then
        [[ -d $dir && -z $(ls -A "$dir") ]] ||
            die_usage "$dir exists and is not a state folder of container_e2e.sh"
    fi
    mkdir -p "$dir"
    touch "$dir/$MARKER"
    cd "$dir" && pwd
}

# ---- enroot and Pyxis from their release tarballs

build_enroot_pyxis() {
    local state=$1 sources=$2 prefix=$1/prefix src=$1/src
    rm -rf "$src" "$prefix"
    mkdir -p "$src"
    tar -xzf "$sources/$ENROOT_TARBALL" -C "$src"
    tar -xzf "$sources/$PYXIS_TARBALL" -C "$src"
    # enroot's git submodules are not in the tarball: glibc instead of musl (FORCE_GLIBC), with
    # Debian's libbsd (glibc 2.36 lacks strlcpy), Debian's makeself and kernel headers.
    local enroot_src=("$src"/enroot-*) pyxis_src=("$src"/pyxis-*)
    install -D -m 755 "$(command -v makeself)" "${enroot_src[0]}/deps/makeself/makeself.sh"
    touch "${enroot_src[0]}/deps/linux-headers/.stamp"
    make -C "${enroot_src[0]}" -s install prefix="$prefix" sysconfdir="$prefix/etc" \
        FORCE_GLIBC=1 LDLIBS="-l:libbsd.a $(find_libbsd)" >/dev/null 2>&1 ||
        die "enroot did not build (make -C ${enroot_src[0]} FORCE_GLIBC=1 ... shows why)"
    make -C "${pyxis_src[0]}" -s install prefix="$prefix" >/dev/null ||
        die "Pyxis did not build against libslurm-dev"
}

find_libbsd() {
    local lib
    lib=$(ldconfig -p | sed -n 's/^\s*libbsd\.so\.0 (libc6,x86-64) => //p' | sed -n 1p)
    [[ -n $lib ]] || die "libbsd.so.0 not found (libbsd0)"
    echo "$lib"
}

# enroot's folders: the tmpfs, one data and runtime folder per node (each node of the test
# cluster has a hostname of its own and shares this file system). Values are evaluated by enroot.
configure_enroot() {
    local state=$1 tmpfs=$1/enroot
    # shellcheck disable=SC2016  # $(hostname) is for enroot to expand
    cat >"$state/prefix/etc/enroot/enroot.conf.d/container_e2e.conf" <<EOF
# Written by tools/container_e2e.sh.
ENROOT_RUNTIME_PATH $tmpfs/runtime/\$(hostname)
ENROOT_DATA_PATH $tmpfs/data/\$(hostname)
ENROOT_CACHE_PATH $tmpfs/cache
ENROOT_TEMP_PATH $tmpfs/temp
# No compression: squashing is then I/O only (the file is ~1.7 GB instead of ~0.6 GB).
ENROOT_SQUASH_OPTIONS -noI -noD -noF -noX -no-duplicates
EOF
}

mount_tmpfs() {
    local tmpfs=$1/enroot
    mkdir -p "$tmpfs"
    if ! mountpoint -q "$tmpfs"; then
        mount -t tmpfs -o "size=${CONTAINER_TMPFS_SIZE:-12g},mode=0755" tmpfs "$tmpfs"
    fi
    mkdir -p "$tmpfs"/{temp,data,runtime,cache}
}

# ---- Docker: a daemon of our own, for the build only

docker_cli() {
    DOCKER_HOST=unix://$state/docker.sock DOCKER_BUILDKIT=1 "$docker_bin" "$@"
}

start_dockerd() {
    local state=$1 cache=$2 i
    # The daemon's own client, Debian's (a newer one elsewhere on PATH would want buildx).
    docker_bin=/usr/bin/docker
    [[ -x $docker_bin ]] || docker_bin=$(dirname "$(command -v dockerd)")/docker
    [[ -x $docker_bin ]] || die "no docker client in /usr/bin (docker.io)"
    mkdir -p "$state/bin"
    ln -sfn "$docker_bin" "$state/bin/docker" # what enroot import runs
    # The exec root holds containerd's sockets: a short path (sockets are limited to 108 bytes).
    exec_root=$(mktemp -d /tmp/container-e2e-exec.XXXXXX)
    echo "$exec_root" >"$state/dockerd.exec-root"
    # No bridge, NAT or iptables rules (builds use --network host); nofile: this sandbox may not
    # raise the open-files limit (setrlimit RLIMIT_NOFILE: Operation not permitted).
    dockerd --data-root "$cache/docker" --exec-root "$exec_root" -H "unix://$state/docker.sock" \
        --pidfile "$state/dockerd.pid" --iptables=false --ip6tables=false --bridge=none \
        --ip-forward=false --ip-masq=false --default-ulimit nofile=20000:20000 \
        >"$state/dockerd.log" 2>&1 {lock}>&- & # (the daemon must not hold the cache's lock)
    for ((i = 0; i < 300; i++)); do
        if docker_cli version >/dev/null 2>&1; then
            return 0
        fi
        kill -0 $! 2>/dev/null || break
        sleep 0.2
    done
    die "dockerd did not start: $(tail -3 "$state/dockerd.log")"
}

stop_dockerd() {
    local state=$1 pid i
    if [[ -s $state/dockerd.pid ]]; then
        pid=$(<"$state/dockerd.pid")
        if kill -0 "$pid" 2>/dev/null; then
            kill -TERM "$pid"
            for ((i = 0; i < 300; i++)); do
                kill -0 "$pid" 2>/dev/null || break
                sleep 0.1
            done
            kill -KILL "$pid" 2>/dev/null || true
        fi
        rm -f "$state/dockerd.pid"
    fi
    if [[ -s $state/dockerd.exec-root ]]; then
        local exec_root
        exec_root=$(<"$state/dockerd.exec-root")
        # containerd's mounts under the exec root, if the daemon left any
        { grep -o " $exec_root/[^ ]*" /proc/mounts || true; } | sort -r | while read -r m; do
            umount -l "$m" 2>/dev/null || true
        done
        rm -rf "$exec_root"
        rm -f "$state/dockerd.exec-root"
    fi
    rm -f "$state/docker.sock"
}

# ---- Images

# The Debian root file system, once per cache (mmdebstrap from Debian's mirror).
debian_rootfs() {
    local cache=$1 suite=${CONTAINER_SUITE:-bookworm} tar
    tar=$cache/rootfs-$suite-$(echo "$DEBIAN_PACKAGES" | md5sum | cut -c1-8).tar
    if [[ ! -s $tar ]]; then
        mmdebstrap --quiet --format=tar --variant=apt --aptopt='Apt::Install-Recommends "false"' \
            --include="$DEBIAN_PACKAGES" "$suite" "$tar.partial" >&2 ||
            die "mmdebstrap $suite failed"
        mv "$tar.partial" "$tar"
    fi
    echo "$tar"
}

# The pinned torch of requirements.txt as a wheel for the stand-in's Python (Debian 12: 3.11).
torch_wheel() {
    local cache=$1 pin
    pin=$(grep -E '^torch==' "$repo_dir/requirements.txt") || die "no torch== pin in requirements.txt"
    mkdir -p "$cache/wheels"
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
        --implementation cp --abi cp311 --platform manylinux_2_28_x86_64 \
        -d "$cache/wheels" "$pin" >&2 || die "pip could not download $pin"
    find "$cache/wheels" -name "torch-${pin#torch==}[+-]*.whl" | sort | sed -n 1p
}

# Stand-in base: Debian imported (once per root file system), then the stand-in Dockerfile
# (Docker's layer cache rebuilds it only when its inputs change).
build_standin() {
    local state=$1 cache=$2 rootfs wheel debian ctx
    rootfs=$(debian_rootfs "$cache")
    debian=llama-fp8-debian:$(sha256sum "$rootfs" | cut -c1-12)
    if ! docker_cli image inspect "$debian" >/dev/null 2>&1; then
        docker_cli import "$rootfs" "$debian" >/dev/null
    fi
    wheel=$(torch_wheel "$cache")
    [[ -n $wheel ]] || die "pip downloaded no torch wheel"
    ctx=$state/standin-context
    rm -rf "$ctx"
    mkdir -p "$ctx/wheels" "$ctx/te_double/te_double"
    cp /etc/ssl/certs/ca-certificates.crt "$ctx/"
    ln "$wheel" "$ctx/wheels/" 2>/dev/null || cp "$wheel" "$ctx/wheels/"
    cp -r "$repo_dir/tests/te_double/site/transformer_engine" "$ctx/te_double/"
    cp "$repo_dir"/tests/te_double/{__init__,reference}.py "$ctx/te_double/te_double/"
    find "$ctx" -name __pycache__ -prune -exec rm -rf {} +
    docker_cli build --quiet --network host --build-arg "DEBIAN_IMAGE=$debian" \
        --build-arg "TE_VERSION=$(image_te_version)" -t llama-fp8-standin:latest \
        -f "$repo_dir/tests/container/standin-base.dockerfile" "$ctx" >/dev/null ||
        die "the stand-in base did not build"
    rm -rf "$ctx"
}

# The TE release the NGC image ships (model_utils/precision/te.py), for the double's metadata.
image_te_version() {
    sed -n 's/^IMAGE_TE_VERSION = "\(.*\)"$/\1/p' "$repo_dir/model_utils/precision/te.py"
}

# The recipe's image: its Dockerfile unchanged, on the stand-in. Docker logs only CACHED for a
# step that ran before on the same inputs (the stand-in, the Dockerfile, requirements.txt): the
# log of the build that ran them is kept under those inputs and added, for every step's output.
build_recipe_image() {
    local state=$1 log=$1/docker-build.log kept no_cache=()
    kept=$(docker_cli image inspect -f '{{.Id}}' llama-fp8-standin:latest |
        cat - "$repo_dir"/{0.transformer-engine.dockerfile,requirements.txt} | sha256sum | cut -c1-16)
    kept=$2/build-logs/$kept.log
    [[ -s $kept ]] || no_cache=(--no-cache)
    (cd "$repo_dir" && docker_cli build "${no_cache[@]}" --progress=plain --network host \
        --build-arg BASE_IMAGE=llama-fp8-standin:latest -t "$IMAGE_TAG" \
        -f 0.transformer-engine.dockerfile .) >"$log" 2>&1 ||
        die "docker build -f 0.transformer-engine.dockerfile failed: $(grep -E 'ERROR|error' \
            "$log" | tail -3) (all of it: $log)"
    if [[ -s $kept ]]; then
        sed 's/^/(the build the cached steps come from) /' "$kept" >>"$log"
    else
        mkdir -p "${kept%/*}" && cp "$log" "$kept.partial" && mv "$kept.partial" "$kept"
    fi
    # The previous builds' layers; the build cache keeps the newest (the stand-in's included).
    docker_cli image prune --force >/dev/null
    docker_cli builder prune --force --keep-storage 3gb >/dev/null
}

import_squashfs() {
    local state=$1
    rm -f "$state/transformer-engine.sqsh"
    PATH=$state/bin:$state/prefix/bin:$PATH DOCKER_HOST=unix://$state/docker.sock \
        enroot import -o "$state/transformer-engine.sqsh" "dockerd://$IMAGE_TAG" \
        >"$state/enroot-import.log" 2>&1 ||
        die "enroot import failed: $(tail -3 "$state/enroot-import.log")"
}

# After a build: no daemon left; after a failed one, no tmpfs either.
build_cleanup() {
    local status=$? state=$1
    stop_dockerd "$state"
    if ((status != 0)) && mountpoint -q "$state/enroot"; then
        umount "$state/enroot" || umount -l "$state/enroot"
    fi
}

cmd_build() {
    check_prerequisites
    local state sources cache
    sources=$(sources_dir)
    state=$(state_dir "${1:-}")
    cache=$(cache_dir)
    [[ ! -s $state/slurm/slurmctld.pid ]] || die_usage "$state has a running cluster: stop it first"
    # One build at a time per cache (the Docker data root is in it).
    exec {lock}>"$cache/.lock"
    flock "$lock"
    stop_dockerd "$state" # one an earlier, interrupted build left running
    # shellcheck disable=SC2064  # the folder now: the trap may run where $state is gone
    trap "build_cleanup $(printf %q "$state")" EXIT
    phase "enroot + Pyxis from $sources" build_enroot_pyxis "$state" "$sources"
    mount_tmpfs "$state"
    configure_enroot "$state"
    start_dockerd "$state" "$cache"
    phase "stand-in base image (Debian rootfs and torch wheel cached in $cache)" \
        build_standin "$state" "$cache"
    phase "docker build -f 0.transformer-engine.dockerfile" build_recipe_image "$state" "$cache"
    phase "enroot import -o $state/transformer-engine.sqsh" import_squashfs "$state"
    stop_dockerd "$state"
    trap - EXIT
    rm -rf "$state/enroot/temp"/* # import leftovers; the tmpfs stays for the containers
    note "built: $state/transformer-engine.sqsh ($(du -h "$state/transformer-engine.sqsh" | cut -f1))"
}

# ---- The cluster

cmd_start() {
    check_prerequisites
    local state
    state=$(state_dir "${1:-}")
    [[ -f $state/transformer-engine.sqsh && -x $state/prefix/bin/enroot ]] ||
        die_usage "$state holds no squash file or enroot: run \`container_e2e.sh build $state\`"
    mount_tmpfs "$state"
    # Pyxis: each job's named containers are removed when the job ends (container_scope=job);
    # they are unpacked into the tmpfs, ~1.8 GB each.
    local plugstack="required $state/prefix/lib/slurm/spank_pyxis.so"
    plugstack+=" runtime_path=$state/enroot/pyxis container_scope=job"
    mkdir -p "$state/enroot/pyxis"
    link_enroot "$state"
    # slurmd (so Pyxis) finds enroot on its PATH.
    PATH=$state/prefix/bin:$PATH SLURM_CLUSTER_PLUGSTACK=$plugstack \
        SLURM_CLUSTER_NODES=${SLURM_CLUSTER_NODES:-2} \
        "$repo_dir/tools/slurm_cluster.sh" start "$state/slurm"
    echo "export IMAGE=$state/transformer-engine.sqsh"
}

# Pyxis's job epilog (it removes the job's containers) runs enroot with PATH
# /usr/local/bin:/usr/bin:/bin whatever slurmd's PATH: enroot must be there, as on a real
# cluster. A link to this state's enroot (which keeps this state's configuration), removed by
# stop; another state's link is replaced only if that state is gone or stopped.
readonly SYSTEM_ENROOT=/usr/local/bin/enroot
link_enroot() {
    local state=$1 target other
    if [[ -e $SYSTEM_ENROOT || -L $SYSTEM_ENROOT ]]; then
        target=$(readlink "$SYSTEM_ENROOT" || true)
        other=${target%/prefix/bin/enroot}
        [[ -n $target && $target != "$other" ]] ||
            die_usage "$SYSTEM_ENROOT exists and is not a link made by container_e2e.sh"
        if [[ $other != "$state" && -s $other/slurm/slurmctld.pid ]] &&
            kill -0 "$(<"$other/slurm/slurmctld.pid")" 2>/dev/null; then
            die_usage "another container cluster ($other) uses $SYSTEM_ENROOT: stop it first"
        fi
    fi
    ln -sfn "$state/prefix/bin/enroot" "$SYSTEM_ENROOT"
}

unlink_enroot() {
    local state=$1
    if [[ -L $SYSTEM_ENROOT && $(readlink "$SYSTEM_ENROOT") == "$state/prefix/bin/enroot" ]]; then
        rm -f "$SYSTEM_ENROOT"
    fi
}

cmd_stop() {
    local dir=${1:-} purge=${2:-}
    [[ -n $dir && -f $dir/$MARKER ]] || die_usage "'$dir' is not a state folder of container_e2e.sh"
    [[ -z $purge || $purge == --purge ]] || usage
    local state
    state=$(cd "$dir" && pwd)
    if [[ -f $state/slurm/.slurm_cluster_state ]]; then
        "$repo_dir/tools/slurm_cluster.sh" stop "$state/slurm"
    fi
    unlink_enroot "$state"
    stop_dockerd "$state"
    if mountpoint -q "$state/enroot"; then
        umount "$state/enroot" || umount -l "$state/enroot"
    fi
    [[ $purge != --purge ]] || rm -rf "$state"
}

main() {
    [[ $# -ge 1 ]] || usage
    local cmd=$1
    shift
    case $cmd in
    build) cmd_build "$@" ;;
    start) cmd_start "$@" ;;
    stop) cmd_stop "$@" ;;
    *) usage ;;
    esac
}

main "$@"
