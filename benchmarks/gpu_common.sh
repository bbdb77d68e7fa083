# shellcheck shell=bash
# What the GPU scripts of benchmarks/ share (sourced, not run): their OUT_DIR, their Python, and
# the rule that they never replace a run folder: each launch is a new folder in OUT_DIR.

# out_dir SCRIPT USAGE ARG: ARG as an absolute path, not made yet (each script makes it once all
# its checks passed); none given, or a flag where OUT_DIR belongs, is the usage line and exit 2.
out_dir() {
    if [ -z "${3:-}" ] || [ "${3#-}" != "$3" ]; then
        echo "$1: OUT_DIR comes first (got '${3:-}'): $2" >&2
        exit 2
    fi
    [ ! -e "$3" ] || [ -d "$3" ] || { echo "$1: OUT_DIR $3 is a file, not a folder: $2" >&2; exit 2; }
    realpath -m -- "$3"
}

# fresh SCRIPT OUT NAME...: exit 2, before anything runs, where OUT already holds one of the
# run folders NAME... (a finished run is never deleted to make room for another).
fresh() {
    local script=$1 out=$2 name
    shift 2
    for name in "$@"; do
        [ ! -e "$out/$name" ] || {
            echo "$script: $out/$name holds a run already: give a new OUT_DIR or move it away" >&2
            exit 2
        }
    done
}

# launch RUN_NAME RECIPE FLAGS...: a user's launch (bash 1.train_llama.sbatch --recipe RECIPE
# FLAGS...) into the new run folder $out/RUN_NAME ($out: the script's OUT_DIR).
launch() { RUNS_DIR=$out RUN_NAME=$1 bash "$root/1.train_llama.sbatch" --recipe "${@:2}"; }

# The Python of analysis/ and benchmarks/: $PYTHON, else the checkout's .venv (what make
# builds), else python3 on PATH (a GPU machine's container).
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
[ -x "$python" ] || python=python3
