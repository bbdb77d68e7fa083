#!/usr/bin/env bash
# Does the FP8 gap close, hold or grow over a whole schedule? The long-horizon loss A/B, sized so
# that every arm runs 3,000 optimizer steps on real text within one GPU visit (two calls).
#
#   bash benchmarks/gpu_long_ab.sh OUT_DIR --arms bf16-a,bf16-b,fp8     # call 1 (TE set up)
#   bash benchmarks/gpu_long_ab.sh OUT_DIR --arms fp8-current,fp8-closer # call 2, same OUT_DIR
#   bash benchmarks/gpu_long_ab.sh OUT_DIR --arms none                  # the verdicts alone
#   bash benchmarks/gpu_long_ab.sh OUT_DIR --dry_run                    # every arm on a CPU
#
# GPU: a Llama-shaped model of 101M parameters (width 768, 12 layers, 12 heads, 4 KV heads, FFN
# 2048, vocab 32768: the code corpus's tokenizer; embeddings tied as the 1B's) through the
# launcher on the shipped 1B recipe's settings (--recipe llama3.2-1b-*: TE, --compile, delayed
# scaling on the FP8 side), with the shape, data and schedule overridden: micro-batch 7 x 1,024
# tokens, STEPS steps (default 3,000: 21.5M tokens of tools/make_code_corpus.py's 23.0M training
# tokens, none read twice), lr 6e-4 cosine to 6e-5 after 300 warm-up steps, the held-out text
# validated every VAL_FREQ steps (default 250), no checkpoints. The arms of one call train at
# the same time (on the GPU each alone is host-bound and leaves most of it idle; one after
# another, three would overrun a 10-minute call by an estimate), each logging to
# OUT_DIR/ARM.log: their losses per step are the point, and their times, shared, say nothing of
# FP8's speed (gpu_parity.sh measures that). The arms:
#   bf16-a       the BF16 reference (--seed 42)
#   bf16-b       its seed replica (--seed 43 --data_seed 42: the same tokens in the same order)
#   fp8          the shipped FP8 recipe (delayed scaling, amax history 1024 / max)
#   fp8-current  current scaling
#   fp8-closer   the gap-closer (CLOSER, default: current scaling with the first and last layers
#                in BF16, NVIDIA's convergence default; docs/recipes.md lists the others)
# Arms already in OUT_DIR are kept (asking for one again is refused), so two calls fill one
# folder; after the arms, every arm present is judged by compare_runs against bf16-a, inside the
# noise band bf16-b spans
# (--replicas 2): verdict.txt (each arm's gaps, step lag at every validation, matched time, same
# loss, verdict), compare.png, long_ab.log (every line printed). A 101M model's run tells how
# FP8's gap moves with the steps and the LR schedule at a fixed recipe; it cannot tell a 1B-8B
# model's gap, whose outliers grow with width and depth (docs/recipes.md).
#
# --dry_run: the tiny preset on the bundled corpus, one CPU worker, STEPS (default 12) steps of
# 2 x 64 tokens in fp32 (FP8 emulated by torchao: its tensorwise, rowwise and tensorwise with
# the first and last layers in BF16 stand in for delayed, current and the closer); make test
# runs it (tests/integration/test_parity_run.py).
set -euo pipefail

usage="usage: bash benchmarks/gpu_long_ab.sh OUT_DIR [--dry_run] [--arms NAME,...|none]"
source "$(dirname "$0")/gpu_common.sh"
out=$(out_dir "$usage" "${1:-}")
shift
dry='' arms=bf16-a,bf16-b,fp8,fp8-current,fp8-closer
while [ $# -gt 0 ]; do
    case $1 in
        --dry_run) dry=--dry_run ;;
        --arms) if [ -z "${2:-}" ] || [ "${2#-}" != "$2" ]; then
                refuse "--arms needs its NAME,... or none (e.g. --arms bf16-a,bf16-b,fp8): $usage"
            fi
            arms=$2; shift ;;
        *) refuse "no option '$1': $usage" ;;
    esac
    shift
done

if [ -n "$dry" ]; then
    recipe=tiny
    steps=${STEPS:-12} warmup=${WARMUP:-2} val_freq=${VAL_FREQ:-4}
    export NPROC_PER_NODE=${NPROC_PER_NODE:-1}
    shared=(--max_context_width 64 --train_batch_size 2 --bf16=0 --lr 1e-3 --min_lr 1e-4)
    current=(--fp8_recipe rowwise)
    read -r -a closer <<< "${CLOSER:---bf16_layers 0,-1}"
else
    recipe=llama3.2-1b
    steps=${STEPS:-3000} warmup=${WARMUP:-300} val_freq=${VAL_FREQ:-250}
    text=${DATA:-$root/.gpu/text}
    [ -f "$text/code.jsonl.gz" ] || {
        refuse "no $text/code.jsonl.gz: run .venv/bin/python -m tools.make_code_corpus --out $text and carry it"
    }
    shared=(--dataset "$text/code.jsonl.gz" --tokenizer "$text/tokenizer" --vocab_size 32768
        --hidden_width 768 --num_layers 12 --num_heads 12 --num_key_value_heads 4
        --intermediate_size 2048 --max_context_width 1024 --train_batch_size 7
        --lr 6e-4 --min_lr 6e-5)
    current=(--fp8_recipe current)
    read -r -a closer <<< "${CLOSER:---fp8_recipe current --bf16_layers 0,-1}"
fi
shared+=(--max_steps "$steps" --warmup "$warmup" --validation_freq "$val_freq"
    --validation_batches 8 --logging_freq 1 --checkpoint_freq -1)

arm_flags() {  # arm_flags NAME: the recipe and flags of one arm
    case $1 in
        bf16-a) echo "$recipe-bf16 --seed 42" ;;
        bf16-b) echo "$recipe-bf16 --seed 43 --data_seed 42" ;;
        fp8) echo "$recipe-fp8" ;;
        fp8-current) echo "$recipe-fp8 ${current[*]}" ;;
        fp8-closer) echo "$recipe-fp8 ${closer[*]}" ;;
        *) refuse "--arms: no arm '$1' (bf16-a, bf16-b, fp8, fp8-current, fp8-closer, or none)" ;;
    esac
}

[ "$arms" = none ] && arms=
IFS=, read -r -a wanted <<< "$arms"
twice=$(printf '%s\n' "${wanted[@]}" | sort | uniq -d | head -1)
[ -z "$twice" ] || refuse "--arms: $twice given twice (each arm is one run folder)"
for name in "${wanted[@]}"; do arm_flags "$name" > /dev/null; done  # every name, before any run
for name in "${wanted[@]}"; do  # and every arm's flags
    read -r -a flags <<< "$(arm_flags "$name")"
    check "$name" "${flags[@]}" "${shared[@]}"
done
checked

mkdir -p "$out"
{
    echo "# gpu_long_ab.sh ${dry:-(GPU)} on $(hostname) at $(date -u +%FT%TZ), git $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')"
    nvidia-smi --query-gpu=name,driver_version,compute_mode --format=csv,noheader 2>/dev/null || true
    # arms at once share the host's cores: an equal part each for their tokenizer threads
    share=$(( $(nproc) / (${#wanted[@]} > 0 ? ${#wanted[@]} : 1) )) && share=$(( share > 0 ? share : 1 ))
    export RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-$share}
    pids=()
    for name in "${wanted[@]}"; do
        read -r -a flags <<< "$(arm_flags "$name")"
        launch "$name" "${flags[@]}" "${shared[@]}" > "$out/$name.log" 2>&1 &
        pids+=("$!")
    done
    for pid in "${pids[@]}"; do
        wait "$pid" || echo "gpu_long_ab.sh: an arm failed: see its log, $out/ARM.log"
    done
    runs=() labels=()
    for name in bf16-a bf16-b fp8 fp8-current fp8-closer; do
        [ ! -f "$out/$name/metrics.jsonl" ] || { runs+=("$out/$name"); labels+=("$name"); }
    done
    replicas=1
    [ ! -f "$out/bf16-b/metrics.jsonl" ] || replicas=2
    if [ "${#runs[@]}" -gt "$replicas" ] && [ "${runs[0]}" = "$out/bf16-a" ]; then
        {
            echo "(the arms of a call trained at once: the lines at equal wall-clock and the speed to the same loss compare shared times; read the steps, losses and step lags)"
            (cd "$root" && "$python" -m analysis.compare_runs "${runs[@]}" --replicas "$replicas" \
                --labels "$(IFS=,; echo "${labels[*]}")" --output "$out/compare.png")
        } | tee "$out/verdict.txt"
    else
        echo "gpu_long_ab.sh: no verdict yet: bf16-a and an FP8 arm are not both in $out"
    fi
} 2>&1 | tee -a "$out/long_ab.log"
