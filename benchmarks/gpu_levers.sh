#!/usr/bin/env bash
# The speed levers measured on one GPU: each phase fits in one 10-minute call on a lent GPU
# machine (../shared/gpu/README.md: set up TE first).
#
#   bash benchmarks/gpu_levers.sh PHASE OUT_DIR
#
#   loss    the loss alone (bench_loss_kernel.py --device cuda), HF vs chunked vs chunked under
#           --compile, at micro-batch 2 and 4 of seq 8192 (Llama 3 shapes)             ~1 min
#   levers  4 Llama3-8B layers, seq 8192, 20 steps: te-fp8 mb2 with and without the chunked loss,
#           te-bf16 and te-fp8 at mb4, te-fp8 mb4 with --fp8_attention                   ~6 min
#   masters te-bf16 and te-fp8 at mb4 with fp32 parameters (FSDP2 casts them to bf16 every
#           gather) and with --master_weights optimizer (bf16 parameters, TE's FusedAdam
#           keeping fp32 masters: no per-step cast, bf16 gradients), and te-fp8 mb4 with
#           FP8 parameters trained from those masters (--fp8_weights: FP8 gathers, no
#           per-step weight quantisation)                                               ~6 min
#   compile te-fp8 mb2 and mb4, eager and under --compile (layers and loss chunks)       ~5 min
#   reshard te-fp8 mb4 with FSDP2's default resharding and with --reshard_after_forward
#           never (backward neither gathers nor casts the parameters again)            ~3 min
#   ac      what each AC setting keeps and costs in TE's Llama3-8B layer (4 layers, one
#           8k sequence: bench_activation_checkpointing.py); then te-fp8 mb4 without AC, with
#           every other layer recomputed, and with only the MLPs recomputed (--ac_scope mlp:
#           TE's LayerNormMLP recompute), and mb6 with the MLPs                        ~7 min
#   best    the levers that held the loss, together (--compile, --master_weights optimizer,
#           --reshard_after_forward never) at mb4, on te-fp8 and on te-bf16: FP8's speed-up
#           with the same levers on both sides                                         ~3 min
#   tier    the GPU tier's cuDNN, FP8-attention, MLP-recompute, masters, FP8-weights, validation
#           and one-seed tests (~9-11 min: safer as two calls, TIER_K="cudnn or fp8_attention or
#           fp8_weights" then the rest); TIER_K=EXPR picks others: "gap_closer or cool_down"
#   attention  te-fp8 mb4 with and without --fp8_attention (cuDNN's FP8 attention)     ~2 min
#   torchao torchao's float8 (tensorwise + float8 all-gather) against TE's delayed scaling,
#           both at mb4 under --compile: the torchao/te goal with every lever on both   ~3 min
#   depth   te-bf16 and te-fp8 at mb2 with 4 and with 8 layers: the FP8 speed-up as lm_head's
#           share of the work shrinks (8 layers: ~72 GiB by arithmetic, fits an H100)  ~5 min
#   full-torchao  a whole Llama 3.2 1B (16 layers, tied, seq 8192, mb4): torchao's float8
#           under --compile; needs no TE, so it can run while TE's chunks travel        ~2 min
#   full    the same model's A/B with the same levers on both sides (te-bf16 and te-fp8
#           delayed, mb4, --compile, fp32 masters in the optimizer, no resharding), steps
#           19-20 profiled; then analysis/step_breakdown.py's breakdown and FP8 ceiling of the
#           pair and compare_runs' table of both (and of full-torchao's run if it is in OUT_DIR)
#                                                                                       ~5 min
#   attention-3b  past the linears-only ceiling on the 3B recipe (micro-batch 2, head_dim 128):
#           te-bf16, te-fp8, and te-fp8 with --fp8_attention (cuDNN's FP8 attention), 30 steps
#           each through the launcher, steps 20-21 profiled; step_breakdown of each FP8 run
#           against the bf16 one (its what-ifs: attention's share measured)        ~9 min
#   scaling-1b  delayed against current scaling under --compile on the 1B recipe, 30 steps
#           each through the launcher, steps 20-21 profiled, with torch's graph-break and
#           recompile logs (TORCH_LOGS): what compile compiles around TE, counted per run;
#           compare_runs of the two                                                 ~5 min
#   host-1b  the host gap on the 1B recipe: te-fp8 under FSDP2 (the shipped recipe) against
#           te-fp8 and te-bf16 with --sharding_strategy none (no FSDP2 in a world of one: no
#           per-step parameter copies), 30 steps each through the launcher, steps 20-21
#           profiled; step_breakdown of each FP8 run against the bf16 one (the GPU's wait for
#           the host, measured), compare_runs of the three                        ~6 min
#   graphs-1b  first the GPU tier's test of no FSDP2 and CUDA graphs (losses against FSDP2 and
#           eager, a graphed resume); then the 1B without FSDP2 and with each layer a CUDA
#           graph (--cuda_graphs; eager around the graphs: not with --compile), te-bf16 and
#           te-fp8: FP8's speed-up with graphs on both sides, step_breakdown of the pair,
#           compare_runs with host-1b's runs where they are in OUT_DIR            ~6 min
#   8b-bf16, 8b-fp8  the whole Llama 3.1 8B on one H200 (an H100 is refused), one arm per call:
#           the llama3-8b recipe at micro-batch 2 with fp32 parameters as masters and torchao's
#           8-bit moments (75 GiB of state, ~111 GiB in all by the 4-layer slices' arithmetic),
#           30 steps, profiled; 8b-fp8 ends with step_breakdown and compare_runs    ~5 min each
#           (both calls on one warm machine into one OUT_DIR outside $OUT, e.g. /tmp/8b, then
#           copy what should come back into $OUT)
#
# Everything a phase prints goes to OUT_DIR/PHASE.log as well; the matrix rows' run folders
# (metrics.jsonl) go to OUT_DIR/PHASE-LAYERS-layers/. A session's device time holds TE's set-up
# and one or two phases (`loss` needs no TE: run it while the chunks travel). Not yet run on a
# GPU: attention-3b, scaling-1b, host-1b, graphs-1b and the 8B (issue 65's queue).
set -euo pipefail

phases="loss|levers|masters|compile|reshard|ac|best|tier|attention|torchao|depth|full-torchao|full|attention-3b|scaling-1b|host-1b|graphs-1b|8b-bf16|8b-fp8"
usage="usage: bash benchmarks/gpu_levers.sh $phases OUT_DIR"
source "$(dirname "$0")/gpu_common.sh"
phase=${1:-}
[[ $phase != *"|"* && "|$phases|" == *"|$phase|"* ]] || refuse "no phase '$phase': $usage"
[ $# -le 2 ] || refuse "a phase and an OUT_DIR, nothing after: $usage"
out=$(out_dir "$usage" "${2:-}")
[[ $phase == 8b-* ]] && gpu="an H200 (141 GB)" || gpu="a GPU"
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1 || true)
[[ $mib =~ ^[0-9]+$ ]] || refuse "no GPU is visible (nvidia-smi lists none): $phase runs on $gpu"
[[ $phase != 8b-* || $mib -ge 130000 ]] || refuse "$phase runs on $gpu, not on this $mib MiB GPU"
# levers PRESET FOLDER ROWS VS [TRAIN.PY FLAGS...]: the lever rows ROWS of bench_gpu_matrix, 20
# steps each, with each row's speed over row VS's in column A of the table (VS empty: the
# hf-loss baselines); the run folders go to OUT_DIR/FOLDER/.
levers() {
    local preset=$1 folder=$2 rows=$3 vs=$4
    shift 4
    "$python" -m benchmarks.bench_gpu_matrix --preset "$preset" --nproc 1 --max_steps 20 \
        --modes levers --out "$out/$folder" --only "$rows" ${vs:+--vs "$vs"} \
        -- --dataset data/kjv.jsonl.gz --tokenizer data/tokenizer "$@"
}
# matrix ROWS [LAYERS [VS]]: the rows on a slice of LAYERS Llama3-8B layers (default 4).
matrix() { levers llama3-8b "$phase-${2:-4}-layers" "$1" "${3:-}" --num_layers "${2:-4}"; }
# full_depth ROWS [VS [TRAIN.PY FLAGS...]]: the rows on the whole Llama 3.2 1B.
full_depth() { levers llama3.2-1b full "$1" "${2:-}" "${@:3}"; }
BEST_BF16="te-bf16 mb4 +compile +masters +no-reshard +expandable"
BEST_FP8="te-fp8 mb4 +compile +masters +no-reshard +expandable"
TORCHAO="torchao-fp8 mb4 +ag +compile +expandable"
folder() { echo "$out/full/${1// /_}"; }
# recipe RUN_NAME RECIPE FLAGS...: a user's launch of a shipped recipe, 30 steps, profiled; one
# validation window at the end (the bundled corpus holds 7 of 8192 tokens); via=check: its check
recipe() {
    ${via:-launch} "$1" "$2" --max_steps 30 --warmup 5 --validation_freq 0 --checkpoint_freq -1 \
        --validation_batches 1 --val_batch_size 1 --profile_steps 20:21 \
        --dataset data/kjv.jsonl.gz --tokenizer data/tokenizer "${@:3}"
}
# compiled RUN_NAME RECIPE FLAGS...: recipe under torch's graph-break and recompile logs, what
# --compile compiles around TE, counted from OUT_DIR/RUN_NAME.compile.log
compiled() {
    [ -z "${via:-}" ] || { recipe "$@"; return; }
    TORCH_LOGS=graph_breaks,recompiles recipe "$@" 2>&1 | tee "$out/$1.compile.log"
    echo "$1 under --compile: $(grep -c 'Graph break in user code' "$out/$1.compile.log" || true) distinct graph breaks, $(grep -c 'Graph break' "$out/$1.compile.log" || true) in all, $(grep -c 'Recompiling function' "$out/$1.compile.log" || true) recompiles"
}
# launches: the phase's launches of shipped recipes, in order; via=check launches: their checks
launches() {
    local graphs=(--sharding_strategy none --compile=0 --cuda_graphs)
    case $phase in
    attention-3b)
        recipe 3b-bf16 llama3.2-3b-bf16
        recipe 3b-fp8 llama3.2-3b-fp8
        recipe 3b-fp8-attention llama3.2-3b-fp8 --fp8_attention ;;
    scaling-1b)
        compiled 1b-delayed llama3.2-1b-fp8 --fp8_recipe delayed
        compiled 1b-current llama3.2-1b-fp8 --fp8_recipe current ;;
    host-1b)
        recipe 1b-fp8 llama3.2-1b-fp8
        recipe 1b-fp8-none llama3.2-1b-fp8 --sharding_strategy none
        recipe 1b-bf16-none llama3.2-1b-bf16 --sharding_strategy none ;;
    graphs-1b)
        recipe 1b-bf16-graphs llama3.2-1b-bf16 "${graphs[@]}"
        recipe 1b-fp8-graphs llama3.2-1b-fp8 "${graphs[@]}" ;;
    8b-bf16 | 8b-fp8)
        # --hang_timeout: step 1 compiles TE's layers and torchao's optimizer step per shape
        PYTORCH_ALLOC_CONF=expandable_segments:True recipe "$phase" "llama3-8b-${phase#8b-}" \
            --preset llama3.1-8b --train_batch_size 2 --optimizer adamw8bit \
            --checkpoint_dir "$ck" --hang_timeout 900 ;;
    esac
}
# The 8B: no checkpoint is written (--checkpoint_freq -1), but a run refuses to start where one
# (~45 GiB here) could not fit, since a preemption saves: /dev/shm when it has more room.
room() {  # room FOLDER: the KiB free where FOLDER is (or will be made)
    local at=$1 && until [ -e "$at" ]; do at=$(dirname "$at"); done
    df -k --output=avail "$at" 2>/dev/null | tail -1 || echo 0
}
ck=$out/$phase/checkpoints
(($(room /dev/shm) > $(room "$out"))) && ck=/dev/shm/$phase-checkpoints
via=check launches
checked

mkdir -p "$out"
{
    echo "# $phase on $(hostname) at $(date -u +%FT%TZ), git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || true
    "$python" -c 'import torch; print("torch", torch.__version__, "cuDNN", torch.backends.cudnn.version())'
    case $phase in
    loss)
        "$python" -m benchmarks.bench_loss_kernel --device cuda --tokens 16384
        "$python" -m benchmarks.bench_loss_kernel --device cuda --tokens 32768
        ;;
    levers)
        matrix "te-fp8 mb2 hf-loss,te-fp8 mb2,te-bf16 mb4 +expandable,te-fp8 mb4 +expandable,te-fp8 mb4 +fp8-attention +expandable"
        ;;
    masters)
        matrix "te-bf16 mb4 +expandable,te-bf16 mb4 +masters +expandable,te-fp8 mb4 +expandable,te-fp8 mb4 +masters +expandable,te-fp8 mb4 +fp8-weights +masters +expandable"
        ;;
    compile)
        matrix "te-fp8 mb2,te-fp8 mb2 +compile,te-fp8 mb4 +expandable,te-fp8 mb4 +compile +expandable"
        ;;
    best)
        matrix "te-fp8 mb4 +compile +masters +no-reshard +expandable,te-bf16 mb4 +compile +masters +no-reshard +expandable"
        ;;
    reshard)
        matrix "te-fp8 mb4 +expandable,te-fp8 mb4 +no-reshard +expandable"
        ;;
    ac)
        "$python" -m benchmarks.bench_activation_checkpointing --repeats 5 -- --model_impl te \
            --fp8=1 --hidden_width 4096 --num_heads 32 --num_key_value_heads 8 \
            --intermediate_size 14336 --max_context_width 8192 --train_batch_size 1
        matrix "te-fp8 mb4 +expandable,te-fp8 mb4 +AC/2 +expandable,te-fp8 mb4 +AC-mlp +expandable,te-fp8 mb6 +AC-mlp +expandable"
        ;;
    tier)
        "$python" -m pytest -m gpu tests/integration/test_gpu.py -k "${TIER_K:-cudnn or fp8_attention or mlp_recompute or one_seed or master_weights or fp8_weights or validation}" -v --durations=0
        ;;
    attention)
        matrix "te-fp8 mb4 +expandable,te-fp8 mb4 +fp8-attention +expandable" 4 "te-fp8 mb4 +expandable"
        ;;
    torchao)
        matrix "torchao-fp8 mb4 +ag +compile +expandable,te-fp8 mb4 +compile +expandable" 4 "te-fp8 mb4 +compile +expandable"
        ;;
    depth)
        matrix "te-bf16 mb2,te-fp8 mb2" 4 "te-bf16 mb2"
        (export PYTORCH_ALLOC_CONF=expandable_segments:True && matrix "te-bf16 mb2,te-fp8 mb2" 8 "te-bf16 mb2")
        ;;
    full-torchao)
        full_depth "$TORCHAO"
        ;;
    full)
        full_depth "$BEST_BF16,$BEST_FP8" "$BEST_BF16" --profile_steps 19:20
        "$python" -m analysis.step_breakdown "$(folder "$BEST_BF16")" "$(folder "$BEST_FP8")"
        runs=("$(folder "$BEST_BF16")" "$(folder "$BEST_FP8")")
        [ -f "$(folder "$TORCHAO")/metrics.jsonl" ] && runs+=("$(folder "$TORCHAO")")
        "$python" -m analysis.compare_runs "${runs[@]}" --output "$out/full-compare.png" || true
        ;;
    attention-3b)
        launches
        "$python" -m analysis.step_breakdown "$out/3b-bf16" "$out/3b-fp8" --no_hta
        "$python" -m analysis.step_breakdown "$out/3b-bf16" "$out/3b-fp8-attention" --no_hta
        "$python" -m analysis.compare_runs "$out/3b-bf16" "$out/3b-fp8" "$out/3b-fp8-attention" \
            --output "$out/attention-3b.png" || true
        ;;
    scaling-1b)
        launches
        "$python" -m analysis.compare_runs "$out/1b-delayed" "$out/1b-current" \
            --output "$out/scaling-1b.png" || true
        ;;
    host-1b)
        launches
        for run in 1b-fp8 1b-fp8-none; do
            "$python" -m analysis.step_breakdown "$out/1b-bf16-none" "$out/$run" --no_hta || true
        done
        "$python" -m analysis.compare_runs "$out/1b-fp8" "$out/1b-fp8-none" "$out/1b-bf16-none" \
            --output "$out/host-1b.png" || true
        ;;
    graphs-1b)
        "$python" -m pytest -m gpu tests/integration/test_gpu.py -k cuda_graphs -v
        launches
        "$python" -m analysis.step_breakdown "$out/1b-bf16-graphs" "$out/1b-fp8-graphs" --no_hta
        runs=("$out/1b-bf16-graphs" "$out/1b-fp8-graphs")
        for run in 1b-fp8-none 1b-bf16-none; do
            [ -f "$out/$run/metrics.jsonl" ] && runs+=("$out/$run")
        done
        "$python" -m analysis.compare_runs "${runs[@]}" --output "$out/graphs-1b.png" || true
        ;;
    8b-bf16 | 8b-fp8)
        df -h "$out" /dev/shm || true
        launches
        [ -d "$out/8b-bf16" ] || echo "gpu_levers.sh: no $out/8b-bf16 to compare with: run 8b-bf16 into this OUT_DIR first"
        [ "$phase" = 8b-bf16 ] || "$python" -m analysis.step_breakdown "$out/8b-bf16" "$out/8b-fp8" --no_hta || true
        [ "$phase" = 8b-bf16 ] || "$python" -m analysis.compare_runs "$out/8b-bf16" "$out/8b-fp8" --output "$out/8b-h200.png" || true
        ;;
    esac
} 2>&1 | tee -a "$out/$phase.log"
