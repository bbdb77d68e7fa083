#!/usr/bin/env bash
# make's install step: .venv built from the pinned requirements once per machine, copied after.
# Most of a build is pip byte-compiling ~73k files (54 of 68 s from local wheels), which every
# Python process needs where PYTHONDONTWRITEBYTECODE is set (CI). So the first build keeps a copy
# (the requirements only, never a checkout's editable install), keyed by the requirement files,
# this script and the interpreter. A later clone copies it (a real copy: an edit in one venv
# reaches no other) and rewrites the paths a venv names itself by (#! lines, activate,
# pyvenv.cfg); Python corrects a .pyc's own path as it loads it.
#   tools/make_venv.sh PYTHON VENV   VENV_CACHE=DIR: ~/.cache/llama-fp8/venvs; empty: keep nothing
set -euo pipefail
python=$1 venv=$2 part=
cache=${VENV_CACHE-${XDG_CACHE_HOME:-$HOME/.cache}/llama-fp8/venvs}
trap '[[ -z $part ]] || rm -rf "$part"' EXIT # a copy stopped half-way
note() { echo "make: $*"; }

build() {
    note "installing the Python environment in $venv (torch for CPU, transformers, pytest...; 2.3 GB):"
    note "      a few minutes the first time on this machine, a line every 30 s; later clones copy it"
    "$python" -m venv "$venv"
    "$venv/bin/pip" install --quiet --upgrade pip
    # one pip call, so torch==2.13.0 (local CPU wheel) constrains the rest; the ticker's sleep
    # dies with it (a caller reading this output would wait for it)
    (
        trap 'kill $! 2>/dev/null; exit 0' TERM
        while sleep 30 & wait $!; do note "installing: $(du -sm "$venv" | cut -f1) MB of ~2,300"; done
    ) &
    local ticker=$! status=0
    "$venv/bin/pip" install --quiet -r requirements.txt -r requirements-dev.txt || status=$?
    kill "$ticker"
    return "$status"
}

# Two makes at once: the first to finish keeps its copy (a failed copy costs the cache, not the
# venv). Beyond two, the least recently used go.
store() {
    if ! part=$(mkdir -p "$cache" && mktemp -d "$cache/.part.XXXXXX" 2>/dev/null); then
        note "cannot write $cache: nothing kept (the venv is fine)" && return 0
    fi
    if cp -a "$venv/." "$part/" && realpath "$venv" > "$part/.origin" && touch "$part/.complete" \
        && mv -T "$part" "$1" 2>/dev/null; then part=; else rm -rf "$part"; fi
    find "$cache" -mindepth 2 -maxdepth 2 -name .complete -printf '%T@ %h\n' | sort -rn \
        | tail -n +3 | cut -d' ' -f2- | while read -r old; do rm -rf "$old"; done
    note "kept a copy of this venv in $1: later clones on this machine copy it"
}

copy() {
    note "copying the Python environment to $venv from $1 (built here before; VENV_CACHE= builds it anew)"
    part=$(mktemp -d "$venv.part.XXXXXX")
    cp -a "$1/." "$part/"; rm "$part/.origin" "$part/.complete" # set -e: a failed copy stops here
    local from to # sed patterns; files replaced (sed -i); grep -r skips bin/python's symlink
    from=$(sed 's/[][\\.*^$|]/\\&/g' "$1/.origin")
    to=$(realpath -m "$venv" | sed 's/[\\&|]/\\&/g')
    { grep -rlIF -f "$1/.origin" "$part/bin" "$part/pyvenv.cfg" || true; } \
        | while read -r file; do sed -i "s|$from|$to|g" "$file"; done
    mv -T "$part" "$venv"
    part=
    touch "$1/.complete" # most recently used
}

entry=
[[ -z $cache ]] || entry=$cache/$({
    cat requirements.txt requirements-dev.txt "${BASH_SOURCE[0]}"
    "$python" -c 'import os, sys; print(sys.version, os.path.realpath(sys.executable))'
} | sha256sum | cut -c1-16)
if [[ -z $entry || -e $venv ]]; then
    build # no cache, or over a venv already here (its extras stay; nothing is kept)
elif [[ -f $entry/.complete ]]; then
    copy "$entry"
else
    build
    store "$entry"
fi
# The recipe itself, editable, no dependencies: scripts and torchrun workers import model_utils
# from wherever they run; setuptools' banners go to a log, shown only if the install fails.
"$venv/bin/pip" install --quiet --no-deps --no-build-isolation -e . > "$venv/install-editable.log" 2>&1 \
    || { cat "$venv/install-editable.log"; exit 1; }
