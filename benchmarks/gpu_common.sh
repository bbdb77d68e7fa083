# shellcheck shell=bash disable=SC2154  # out: the sourcing script's OUT_DIR
# What the GPU scripts of benchmarks/ share (sourced, not run): their OUT_DIR, their Python, the
# checks of every run before the first starts, the rule that they never replace a run folder,
# and bad input as one line on stderr (`PROG: error: ...`), exit 2, before anything is made.
prog=${0##*/}
refuse() { echo "$prog: error: $*" >&2; exit 2; }
for arg; do  # -h/--help (before any `--`): the script's header comment and its usage, exit 0
    [ "$arg" != -- ] || break
    if [ "$arg" = -h ] || [ "$arg" = --help ]; then
        sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0" && echo "$usage" && exit 0
    fi
done

# out_dir USAGE ARG: ARG (from the caller's folder) as an absolute path, not made yet (each
# script makes it once all its checks passed); none given, a flag where OUT_DIR belongs, or one
# that cannot be made (a folder made and removed in its nearest existing one says) is one line
# and exit 2.
out_dir() {
    cd "$here" || exit 2
    if [ -z "${2:-}" ] || [ "${2#-}" != "$2" ]; then
        refuse "no OUT_DIR where the usage has it (got '${2:-}'): $1"
    fi
    [ ! -e "$2" ] || [ -d "$2" ] || refuse "OUT_DIR $2 is a file, not a folder: $1"
    local path parent probe
    path=$(realpath -m -- "$2") && parent=$path
    while [ ! -e "$parent" ]; do parent=$(dirname "$parent"); done
    probe=$(mktemp -d "$parent/.out_dir.XXXXXX" 2> /dev/null) ||
        refuse "OUT_DIR $2 cannot be made: $parent is not a folder you can write in"
    rmdir "$probe"
    echo "$path"
}

# check RUN_NAME RECIPE FLAGS...: before any run of the call starts, that OUT_DIR holds no run
# RUN_NAME (a finished run is never deleted to make room for another), and, in the background,
# the launcher's own check of that launch (train.py --validate_only: flags, data, tokenizer, TE;
# nothing made). checked: waits for those checks; the first refused is the script's refusal.
checks=()
check() {
    [ ! -e "$out/$1" ] || refuse "$out/$1 holds a run already: give a new OUT_DIR or move it away"
    # (a refusal waits for the checks already started: one writing into $said as rm empties it
    # failed rm, and under set -e turned exit 2 into 1; killed, one would leave its folders)
    [ -n "${said:-}" ] || { said=$(mktemp -d) && trap 'wait; rm -rf "$said"' EXIT; }
    checks+=("$1")
    { launch "$@" --validate_only 2> "$said/$1" || : > "$said/$1.no"; } > /dev/null 2>&1 &
}
checked() {
    local name
    wait
    for name in "${checks[@]}"; do
        [ ! -e "$said/$name.no" ] ||
            refuse "the $name run would be refused (nothing ran): $(tail -1 "$said/$name")"
    done
}

# launch RUN_NAME RECIPE FLAGS...: a user's launch (bash 1.train_llama.sbatch --recipe RECIPE
# FLAGS...) into the new run folder $out/RUN_NAME ($out: the script's OUT_DIR).
launch() { RUNS_DIR=$out RUN_NAME=$1 bash "$root/1.train_llama.sbatch" --recipe "${@:2}"; }

# The Python of analysis/ and benchmarks/: $PYTHON, else the checkout's .venv (what make
# builds), else python3 on PATH (a GPU machine's container). Run from the checkout, whatever
# the caller's folder ($here): relative paths are the checkout's, as to the launcher.
here=$PWD root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root" || exit 2
python=${PYTHON:-$root/.venv/bin/python}
[ -x "$python" ] || python=python3
