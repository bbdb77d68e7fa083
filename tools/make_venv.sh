#!/usr/bin/env bash
# The checkout's .venv (make's install step): built from the pinned requirements once per machine,
# copied from the user's cache after that.
#
# Most of a venv build is not downloading but pip byte-compiling ~73k files (54 of 68 s from
# local wheels), which every later Python process needs where PYTHONDONTWRITEBYTECODE is set (CI
# images). So the first build keeps a copy of the venv (the pinned requirements, compiled; never
# this checkout's editable install) under a key of what it was built from: the requirement
# files, this script and the interpreter. A later clone with the same key copies it (a real
# copy, so nothing edited in one checkout's venv reaches another's or the cache) and rewrites the
# absolute paths a venv holds: its scripts' #! lines, bin/activate*, pyvenv.cfg. A .pyc names
# its source's path too, but Python corrects that when it loads the file.
#
#   tools/make_venv.sh PYTHON VENV
#   VENV_CACHE=DIR     where the copies live (default ~/.cache/llama-fp8/venvs); VENV_CACHE=
#                      (empty) builds from the wheels and keeps no copy
set -euo pipefail

python=$1
venv=$2
cache=${VENV_CACHE-${XDG_CACHE_HOME:-$HOME/.cache}/llama-fp8/venvs}
requirements=(requirements.txt requirements-dev.txt)
keep=2 # cached venvs kept, the most recently used: one per requirements change in flight

note() { echo "make: $*"; }

part= # a copy under way: removed if this script stops before it is in place
trap '[[ -z $part ]] || rm -rf "$part"' EXIT

# What the venv is built from: a change to any of it is a new key, so a new build.
venv_key() {
    {
        cat "${requirements[@]}" "${BASH_SOURCE[0]}"
        "$python" -c 'import os, sys; print(sys.version, os.path.realpath(sys.executable))'
    } | sha256sum | cut -c1-16
}

# Rewrite the absolute paths a venv names itself by (from -> to), replacing each file (sed -i
# writes a new one) rather than editing it where it lies.
relocate() {
    local dir=$1 from to
    from=$(printf '%s' "$2" | sed 's/[][\\.*^$|]/\\&/g')
    to=$(printf '%s' "$3" | sed 's/[\\&|]/\\&/g')
    # grep -r passes over symlinks (bin/python names the interpreter itself)
    { grep -rlIF -- "$2" "$dir/bin" "$dir/pyvenv.cfg" || true; } | while read -r file; do
        sed -i "s|$from|$to|g" "$file"
    done
}

build() {
    note "installing the Python environment in $venv (torch for CPU, transformers, torchao,"
    note "      datasets, matplotlib, ruff, pytest; about 2.3 GB installed): a few minutes the first"
    note "      time on this machine, a line every 30 s until it is done; later clones copy it."
    "$python" -m venv "$venv"
    "$venv/bin/pip" install --quiet --upgrade pip
    # One pip call so torch==2.13.0 (local CPU wheel) constrains everything else; pip is quiet,
    # so a ticker says how far the install has come (its sleep dies with it: a caller reading
    # this output would otherwise wait for the sleep to close it).
    (
        trap 'kill $! 2>/dev/null; exit 0' TERM
        while sleep 30 & wait $!; do note "installing: $(du -sm "$venv" | cut -f1) MB of about 2,300 in $venv"; done
    ) &
    local ticker=$! status=0
    "$venv/bin/pip" install --quiet -r requirements.txt -r requirements-dev.txt || status=$?
    kill "$ticker"
    return "$status"
}

# Keep a copy of the fresh venv under its key; two makes at once: the first to finish keeps its.
store() {
    local entry=$1
    mkdir -p "$cache"
    part=$(mktemp -d "$cache/.part.XXXXXX")
    cp -a "$venv/." "$part/"
    realpath "$venv" > "$part/.origin"
    touch "$part/.complete"
    mv -T "$part" "$entry" 2>/dev/null || rm -rf "$part"
    part=
    # the least recently used beyond $keep go (each is ~2.3 GB)
    find "$cache" -mindepth 2 -maxdepth 2 -name .complete -printf '%T@ %h\n' | sort -rn \
        | tail -n +$((keep + 1)) | cut -d' ' -f2- | while read -r old; do rm -rf "$old"; done
    note "kept a copy of this venv in $entry: later clones on this machine copy it"
}

copy() {
    local entry=$1
    note "copying the Python environment to $venv from $entry (built here before; VENV_CACHE= builds it anew)"
    part=$(mktemp -d "$venv.part.XXXXXX")
    cp -a "$entry/." "$part/"
    rm -f "$part/.origin" "$part/.complete"
    relocate "$part" "$(cat "$entry/.origin")" "$(realpath -m "$venv")"
    mv -T "$part" "$venv"
    part=
    touch "$entry/.complete" # most recently used
}

entry=
[[ -z $cache ]] || entry=$cache/$(venv_key)
if [[ -z $entry || -e $venv ]]; then
    build # without a cache, or over a venv already here (its extras stay; nothing is kept)
elif [[ -f $entry/.complete ]]; then
    copy "$entry"
else
    build
    store "$entry"
fi
# The recipe itself, editable and without dependencies (pinned above): scripts, benchmarks and
# torchrun workers import model_utils from wherever they run. setuptools' banners (not errors)
# go to a log, shown only if the install fails.
"$venv/bin/pip" install --quiet --no-deps --no-build-isolation -e . > "$venv/install-editable.log" 2>&1 \
    || { cat "$venv/install-editable.log"; exit 1; }
