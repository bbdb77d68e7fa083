#!/usr/bin/env bash
# System tools the test suite needs beyond the Python venv:
#   slurm-wlm + munge   real Slurm clusters, one node and two (tests/integration/test_slurm_e2e.py)
#   iproute2            `ip netns` for the two-node cluster's network namespaces
#   ShellCheck          lint of every shell script (tests/integration/test_shell_lint.py)
#   docker.io containerd mmdebstrap squashfs-tools build-essential libbsd-dev libslurm-dev
#   makeself jq parallel zstd pigz
#                       the container path (tools/container_e2e.sh): a Docker daemon, a
#                       Debian rootfs for the stand-in base image, enroot and Pyxis built from
#                       ../shared/container (tests/integration/test_container_e2e.py)
# (hadolint, the Dockerfile's lint, is a pip package: requirements-dev.txt.)
#
# Idempotent: installs only what is missing, so `make test` can call it every time at no
# cost. Without root or apt-get (a laptop) it installs nothing, says what is missing and
# exits 0: the tests that need the missing tools then skip and say why. With root and
# apt-get (CI) a failed install is an error.
set -euo pipefail

note() {
    echo "install_test_deps.sh: $*" >&2
}

# Debian package -> the command (or, for a path, the file) that shows it is installed.
declare -A apt_probe=(
    [slurm-wlm]=slurmctld [munge]=munged [iproute2]=ip [shellcheck]=shellcheck
    [docker.io]=dockerd [containerd]=containerd [mmdebstrap]=mmdebstrap
    [squashfs-tools]=mksquashfs [build-essential]=make [libbsd-dev]=/usr/include/bsd/string.h
    [libslurm-dev]=/usr/include/slurm/spank.h [makeself]=makeself [jq]=jq [parallel]=parallel
    [zstd]=zstd [pigz]=pigz
)
missing=()
for package in "${!apt_probe[@]}"; do
    probe=${apt_probe[$package]}
    if [[ $probe == /* ]]; then
        [[ -e $probe ]] || missing+=("$package")
    else
        command -v "$probe" >/dev/null 2>&1 || missing+=("$package")
    fi
done

if ((${#missing[@]} > 0)); then
    if [[ $(id -u) -ne 0 ]]; then
        note "not root: cannot install ${missing[*]}; the tests that need them will skip"
    elif ! command -v apt-get >/dev/null 2>&1; then
        note "no apt-get: cannot install ${missing[*]}; the tests that need them will skip"
    else
        note "installing ${missing[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
fi
