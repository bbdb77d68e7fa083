#!/usr/bin/env bash
# `make test` as CI runs it (a fresh clone, CI=true), several times in a row, each with a CPU hog
# pinned to one core beside it: the suite must not fail because something else runs. Prints one
# line per run (exit status, pytest's counts, wall and CPU time) and writes the logs.
#
#   benchmarks/make_test_under_load.sh [RUNS] [OUT]     (defaults: 3, /tmp/make-test-under-load)
#
# The clone sits beside a link to ../shared (the container path's sources), as CI's does.
set -euo pipefail

runs=${1:-3}
out=${2:-/tmp/make-test-under-load}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
shared=$(cd "$repo/.." && pwd)/shared
mkdir -p "$out"

hog_pid=
stop_hog() {  # never fails: under `set -e` a failed kill or wait would end the loop
    if [[ -n $hog_pid ]]; then
        kill "$hog_pid" 2>/dev/null || true
        wait "$hog_pid" 2>/dev/null || true
    fi
    hog_pid=
}
trap stop_hog EXIT

for ((i = 1; i <= runs; i++)); do
    work=$out/run$i
    rm -rf "$work"
    mkdir -p "$work"
    git clone --quiet "$repo" "$work/main"
    [[ -d $shared ]] && ln -s "$shared" "$work/shared"
    # The hog: one busy process pinned to the first core of this machine's set.
    core=$(python3 -c 'import os; print(min(os.sched_getaffinity(0)))')
    taskset -c "$core" python3 -c 'while True: pass' &
    hog_pid=$!
    status=0
    (cd "$work/main" && CI=true /usr/bin/time -f "wall %e s, user %U s, sys %S s" .ci/run) \
        >"$work/make-test.log" 2>&1 || status=$?
    stop_hog
    counts=$(grep -E "^(=+ )?[0-9]+ (passed|failed)" "$work/make-test.log" | tail -1 || true)
    times=$(grep -E "^wall [0-9.]+ s" "$work/make-test.log" | tail -1 || true)
    echo "run $i: exit $status; ${counts:-no pytest summary}; $times; log $work/make-test.log"
done
