#!/usr/bin/env bash
# Does FP8 train as well as BF16? The whole-model loss A/B, as a user runs it, in one call.
#
#   bash benchmarks/gpu_parity.sh OUT_DIR             # one H100/H200 with TE set up, ~9 min
#   bash benchmarks/gpu_parity.sh OUT_DIR --dry_run   # the A/B and verdict on a CPU, ~1 min
#
# GPU: the shipped Llama 3.2 1B recipes (te-bf16, then te-fp8 delayed; micro-batch 4, seq 8192,
# --compile) through the launcher (bash 1.train_llama.sbatch --recipe ...), on the real text of
# tools/make_code_corpus.py (DATA, default .gpu/text: one transfer), STEPS steps (default 200:
# 6.6M tokens, none read twice; 526 s in all on an H200, benchmarks/results/) with WARMUP
# warm-up steps and cosine decay, the held-out text validated every VAL_FREQ steps, steps
# 110-111 profiled. No checkpoints (a 1B's is 15 GB). Then a 30-step run of the same FP8 recipe with --fp8_numerics (TE's debug tools on the fused layers; its own
# run, so their cost at report steps stays out of the A/B's speed and profile; without --compile,
# which 30 steps would not pay back), compare_runs' table, parity verdict, numerics and picture,
# and step_breakdown's ceiling. Set-up first:
# ../shared/gpu/README.md (TE from six transfers), and .gpu/text travels as one more carry.
#
# FP8_FLAGS after `--` go to the FP8 run and its numerics run: the verdict of a lever
# (`-- --fp8_lm_head`, `-- --fp8_recipe current`, `-- --bf16_layers 0,15`) against the same BF16 run.
#
# --dry_run: the tiny preset on the bundled corpus, one CPU worker, 20 steps of 64 tokens in
# fp32 (the FP8 twin emulated, the other --bf16=0); make
# test runs it with `-- --fp8_numerics` (on the FP8 twin itself, torchao:
# tests/integration/test_parity_run.py); it leaves out the GPU's profile window, numerics run and
# breakdown. Everything lands in OUT_DIR: the run folders bf16/, fp8/ (and fp8-numerics/),
# parity.log (every line printed), compare.png, verdict.txt, breakdown.txt (GPU).
set -euo pipefail

usage="usage: bash benchmarks/gpu_parity.sh OUT_DIR [--dry_run] [-- FP8_FLAGS...]"
source "$(dirname "$0")/gpu_common.sh"
out=$(out_dir "$usage" "${1:-}")
shift
dry=
[ "${1:-}" != --dry_run ] || { dry=--dry_run; shift; }
if [ $# -gt 0 ]; then  # what else the FP8 run (and its numerics run) is judged with
    [ "$1" = -- ] || refuse "'$1' is neither --dry_run nor -- (FP8_FLAGS go after --): $usage"
    shift
fi
fp8_flags=("$@")

if [ -n "$dry" ]; then
    recipe=tiny
    steps=${STEPS:-20} warmup=${WARMUP:-2} val_freq=${VAL_FREQ:-10}
    export NPROC_PER_NODE=${NPROC_PER_NODE:-1}  # one worker, as on the one-GPU machine
    # fp32 twins (FP8 emulated in fp32 either way): a CPU without bf16 units runs bf16 matmuls
    # tens of times slower, and the dry run is the script's path, not bf16's numerics
    data=(--max_context_width 64 --train_batch_size 2 --bf16=0)
else
    recipe=llama3.2-1b
    steps=${STEPS:-200} warmup=${WARMUP:-20} val_freq=${VAL_FREQ:-25}
    text=${DATA:-$root/.gpu/text}
    [ -f "$text/code.jsonl.gz" ] || {
        refuse "no $text/code.jsonl.gz: run .venv/bin/python -m tools.make_code_corpus --out $text and carry it"
    }
    data=(--dataset "$text/code.jsonl.gz" --tokenizer "$text/tokenizer" --profile_steps 110:111)
fi
schedule=(--max_steps "$steps" --warmup "$warmup" --validation_freq "$val_freq"
    --validation_batches 4 --logging_freq 1 --checkpoint_freq -1)  # no 15 GB 1B saves
each_run() {  # each_run DO: DO RUN_NAME RECIPE FLAGS... for every run of the call, in order
    $1 bf16 "$recipe-bf16" "${data[@]}" "${schedule[@]}"
    $1 fp8 "$recipe-fp8" "${data[@]}" "${schedule[@]}" "${fp8_flags[@]}"
    [ -n "$dry" ] || $1 fp8-numerics "$recipe-fp8" "${data[@]:0:4}" "${fp8_flags[@]}" \
        --fp8_numerics --compile 0 --max_steps 30 --warmup 3 --logging_freq 10 \
        --validation_freq 0 --checkpoint_freq -1
}
each_run check; checked  # every run's flags, before the 9-minute BF16 run starts

mkdir -p "$out"
{
    echo "# gpu_parity.sh ${dry:-(GPU)} on $(hostname) at $(date -u +%FT%TZ), git $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || true
    each_run launch
    runs=("$out/bf16" "$out/fp8")
    [ -n "$dry" ] || runs+=("$out/fp8-numerics")
    breakdown=()
    [ -n "$dry" ] || breakdown=(--breakdown)
    (cd "$root" && "$python" -m analysis.compare_runs "${runs[@]:0:2}" --output "$out/compare.png" \
        "${breakdown[@]}") | tee "$out/verdict.txt"
    if [ -z "$dry" ]; then
        (cd "$root" && "$python" -m analysis.compare_runs "${runs[@]}" \
            --output "$out/compare-numerics.png") | sed -n '/^FP8 numerics/,$p' | tee -a "$out/verdict.txt"
        (cd "$root" && "$python" -m analysis.step_breakdown "$out/bf16" "$out/fp8") | tee "$out/breakdown.txt"
    fi
} 2>&1 | tee "$out/parity.log"
