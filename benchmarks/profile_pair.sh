#!/usr/bin/env bash
# Where FP8's step goes on one GPU with Transformer Engine: te-bf16 and te-fp8 on 4 Llama3-8B
# layers (seq 8192, micro-batch 2, 8 steps; steps 6-8 traced after one warm-up step), then
# analysis/step_breakdown.py on the pair: each category's ms and share, its speed-up, and FP8's
# Amdahl ceiling against the measured ratio.
#
#   bash benchmarks/profile_pair.sh OUT_DIR        (~2-3 min on one H100, TE installed)
#
# OUT_DIR gets profile_pair.log (all printed) and the run folders te-bf16/ and te-fp8/ (never
# replaced: an OUT_DIR holding one is refused), each with metrics.jsonl and gzip'd Chrome traces
# (profile/step_6/rank_0.pt.trace.json.gz, for ui.perfetto.dev); no checkpoints. PYTHON: the
# interpreter (default: the checkout's .venv). GPU_TESTS=1: the GPU tier's profiling and OOM tests.
set -euo pipefail

usage="usage: bash benchmarks/profile_pair.sh OUT_DIR"
source "$(dirname "$0")/gpu_common.sh"
out=$(out_dir "$usage" "${1:-}")
[ $# -le 1 ] || refuse "one OUT_DIR, nothing after it: $usage"
common=(--preset llama3-8b --num_layers 4 --dataset data/kjv.jsonl.gz --tokenizer data/tokenizer
    --model_impl te --train_batch_size 2 --max_steps 8 --warmup 2 --logging_freq 1
    --checkpoint_freq -1 --validation_batches 1 --profile_steps 6:8)
# launch NAME FP8 [FLAGS...]: train.py on the pair's flags into OUT_DIR/NAME (a world of one)
launch() { "$python" train.py "${common[@]}" --fp8="$2" --output_dir "$out/$1" "${@:3}"; }
check te-bf16 0
check te-fp8 1
checked

mkdir -p "$out"
{
    echo "# profile_pair on $(hostname) at $(date -u +%FT%TZ), git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || true
    "$python" -c 'import torch; print("torch", torch.__version__)'
    for name in te-bf16 te-fp8; do
        fp8=$([ "$name" = te-fp8 ] && echo 1 || echo 0)
        SECONDS=0
        launch "$name" "$fp8"
        echo "# $name: ${SECONDS} s"
    done
    "$python" -m analysis.step_breakdown "$out/te-bf16" "$out/te-fp8"
    if [ "${GPU_TESTS:-0}" = 1 ]; then
        "$python" -m pytest -m gpu tests/integration/test_gpu.py -v --durations=0 \
            -k "profil or oversized or fp8_gemms_under_fp8"
    fi
} 2>&1 | tee "$out/profile_pair.log"
