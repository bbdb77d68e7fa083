#!/usr/bin/env bash
# Download (never install, never import) the pinned pure-Python `transformer-engine` wheel, so
# tests/integration/test_te_contract.py can parse TE's real source with `ast` on a machine without a GPU.
#
# Usage: tools/fetch_te_wheel.sh [VERSION]   -> prints the wheel's path on stdout.
# VERSION defaults to PINNED_TE_VERSION in model_utils/precision/te.py. The wheel is cached in
# $TE_WHEEL_CACHE (default ~/.cache/llama-fp8/te-wheels). Exit 3 = PyPI unreachable.
set -euo pipefail
cd "$(dirname "$0")/.."

version="${1:-$(sed -n 's/^PINNED_TE_VERSION = "\(.*\)"$/\1/p' model_utils/precision/te.py)}"
if [[ -z "$version" ]]; then
    echo "fetch_te_wheel: no PINNED_TE_VERSION in model_utils/precision/te.py" >&2
    exit 1
fi
dest="${TE_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llama-fp8/te-wheels}"
wheel="$dest/transformer_engine-${version}-py3-none-any.whl"

if [[ ! -f "$wheel" ]]; then
    mkdir -p "$dest"
    python="${PYTHON:-.venv/bin/python}"
    if ! log=$("$python" -m pip download --quiet --no-deps --only-binary=:all: \
        --dest "$dest" "transformer-engine==${version}" 2>&1); then
        if grep -qiE "connection|resolve|timed out|unreachable|Max retries|network" <<<"$log"; then
            echo "fetch_te_wheel: PyPI unreachable, cannot download transformer-engine==${version}" >&2
            echo "$log" | tail -n 3 >&2
            exit 3
        fi
        echo "$log" >&2
        exit 1
    fi
fi
[[ -f "$wheel" ]] || { echo "fetch_te_wheel: expected $wheel after download" >&2; exit 1; }
echo "$wheel"
