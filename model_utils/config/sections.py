"""One typed, frozen section per pipeline stage: every flag of the run, declared once, on the
field of the section whose stage reads it (config/run_config.py's Config holds all seven).

    section      type              read by
    model        ModelShape        model/ (the family), report/metrics (FLOPs), checkpoint/ (HF)
    precision    PrecisionConfig   precision/ (the backend), model/ (which implementation)
    data         DataConfig        data/ (tokenizer, corpus, micro-batches)
    optim        OptimConfig       optim.py (AdamW, LR schedule), run/step (accumulation, clip)
    parallel     ParallelConfig    parallel/ (FSDP2, AC, compile), model/loss (chunked)
    checkpoint   CheckpointConfig  checkpoint/ (save, resume, HF import/export)
    run          RunConfig         train.py and run/ (steps, seed, logs, validation, run folder)

Each field is declared once, with flag() or derived() (config/flag_spec.py): its help,
default, choices, range, whether it names a path, and what a resume may do with it (the range
checks are derived from it); the checks between flags live in config/flag_rules.py.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from model_utils.config.argv import precision_name
from model_utils.config.flag_spec import (
    NOT_NEGATIVE,
    POSITIVE,
    Range,
    Resume,
    When,
    derived,
    flag,
    spec_of,
)
from model_utils.config.options import (
    AC_SCOPES,
    DATA_CHECKS,
    MASTER_WEIGHTS,
    MODEL_IMPLS,
    OPTIMIZERS,
    RESHARD_POLICIES,
    SHARDING_STRATEGIES,
    TE_RECIPES,
    TORCHAO_RECIPES,
    TRACKERS,
)

#: Our shape names -> the keys of a Hugging Face config.json: the one mapping table, read by
#: model/modeling.model_config (our shape -> the family's config), config/hf_config (config.json
#: -> our shape) and checkpoint/hf.py (a file that does not fit, in flag words).
HF_KEYS: dict[str, str] = {
    "hidden_width": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_key_value_heads": "num_key_value_heads",
    "intermediate_size": "intermediate_size",
    "vocab_size": "vocab_size",
    "rope_theta": "rope_theta",
    "rope_scaling": "rope_scaling",
    "rms_norm_eps": "rms_norm_eps",
    "max_position_embeddings": "max_position_embeddings",
    "tie_word_embeddings": "tie_word_embeddings",
    "model_family": "model_type",
}


#: The longest collective timeout: a longer one overflows c10d's timer, and no step waits that
#: long (30 days).
MAX_DIST_TIMEOUT_S = 30 * 24 * 3600
#: One past the largest seed: torch.manual_seed overflows beyond, and the data order needs >= 0.
MAX_SEED = 2**63
_SHAPE = "model shape (default: from --preset)"
KEPT, FP8_KNOB = Resume.KEPT, Resume.FP8_KNOB
_BETA = Range(
    low=0, high=1, high_open=True, words="--beta1/--beta2 must be in [0, 1), got {beta1}/{beta2}"
)
#: The conditions flags declare (needs=, excludes=) on FP8, activation checkpointing, no FSDP2.
FP8, AC = When("fp8", words="--fp8=1"), When("activation_checkpointing")
UNSHARDED = When("sharding_strategy", "none")


@dataclass(frozen=True)
class ModelShape:
    """The model's shape and positions: what FLOPs, a checkpoint's tensors and a like-for-like
    comparison hang on. The last four come from the preset or the HF config.json, not flags.

    ``tie_word_embeddings``: one matrix is both the input embedding and the output projection
    (Llama 3.2 1B/3B), trained as one parameter; a tied and an untied model are different
    models, with different checkpoints."""

    hidden_width: int = flag(_SHAPE, resume=KEPT, range=POSITIVE)
    num_layers: int = flag(_SHAPE, resume=KEPT, range=POSITIVE)
    num_heads: int = flag(_SHAPE, resume=KEPT, range=POSITIVE)
    num_key_value_heads: int = flag(_SHAPE + "; < num_heads gives GQA", resume=KEPT, range=POSITIVE)
    intermediate_size: int = flag(_SHAPE, resume=KEPT, range=POSITIVE)
    vocab_size: int = flag(
        _SHAPE + "; must be >= the tokenizer's size", resume=KEPT, range=POSITIVE
    )
    max_context_width: int = flag(
        "sequence length of every packed window (default: from --preset)",
        resume=Resume.FREE,
        range=(
            POSITIVE,
            Range(
                low=2,
                words="{flag} must be >= 2 (one token has no next token to predict), got {value}",
            ),
        ),
    )
    rope_theta: float = flag("RoPE base (default: from --preset)", resume=KEPT, range=POSITIVE)
    tie_word_embeddings: bool = flag(
        "one matrix for the input embedding and lm_head, trained as one parameter "
        "(Llama 3.2 1B/3B; default: from --preset or --init_from_hf's config.json)",
        resume=KEPT,
        before=(False,),
        field_default=False,
    )
    rms_norm_eps: float = derived(KEPT, field_default=1e-5)
    rope_scaling: dict[str, Any] | None = derived(KEPT, field_default=None)
    max_position_embeddings: int | None = derived(Resume.FREE, field_default=None)
    #: config/families.FAMILIES' key (config.json's model_type): from the preset or the HF config.
    model_family: str = derived(KEPT, words="the model family", field_default="llama")

    @property
    def head_dim(self) -> int:
        return self.hidden_width // self.num_heads


#: The model's size: what FLOPs, a checkpoint's tensors and a like-for-like comparison hang on
#: (ModelShape's first six fields, hidden_width to vocab_size).
SHAPE_FIELDS = tuple(f.name for f in fields(ModelShape))[:6]


@dataclass(frozen=True)
class PrecisionConfig:
    """BF16 or FP8, the implementation that computes it, and the FP8 recipe's knobs: the
    fields a resume of the same run may not change (checkpoint/resume.py). --fp8_weights
    (where the weights are kept) and --fp8_all_gather (what FSDP moves) may change: a
    checkpoint stores plain values either way."""

    model_impl: str = flag(
        "te: TE TransformerLayer; te_linear: HF with te.Linear; hf: stock HF; "
        "auto: te when TE and an FP8-capable GPU are present, else hf",
        resume=Resume.EXPERIMENT,
        default="auto",
        choices=MODEL_IMPLS,
    )
    fp8: bool = flag("train the linear layers in FP8", resume=Resume.EXPERIMENT, default=False)
    bf16: bool = flag(
        "compute in bf16 (fp32 master weights); 0 = fp32 compute",
        resume=Resume.EXPERIMENT,
        default=True,
    )
    fp8_recipe: str | None = flag(
        f"torchao: {'|'.join(TORCHAO_RECIPES)} (default {TORCHAO_RECIPES[0]}); "
        f"TE: {'|'.join(TE_RECIPES)} (default {TE_RECIPES[0]})",
        resume=FP8_KNOB,
    )
    fp8_format: str = flag(
        "TE FP8 format", resume=FP8_KNOB, default="hybrid", choices=("hybrid", "e4m3")
    )
    amax_history_len: int = flag(
        "TE delayed scaling history (rows: one per forward, plus one per recomputed layer "
        "under whole-layer AC)",
        resume=FP8_KNOB,
        default=1024,
        range=POSITIVE,
    )
    amax_compute_algo: str = flag(
        "TE delayed", resume=FP8_KNOB, default="max", choices=("max", "most_recent")
    )
    fp8_margin: int = flag("TE scaling margin (powers of 2)", resume=FP8_KNOB, default=0)
    fp8_backward: str = flag(
        "TE >= 2.15, current/block/mxfp8 scaling (TE's backward_override): the backward's "
        "GEMMs in fp8, or in high precision from the forward's high_precision operands or its "
        "FP8 ones dequantized (on --model_impl te_linear: TE's fused MLP has no such backward); "
        "a gap-closer to judge by compare_runs' parity verdict",
        resume=FP8_KNOB,
        default="fp8",
        choices=("fp8", "high_precision", "dequantized"),
        before=("fp8",),
    )
    fp8_weights: bool = flag(
        "TE: keep weights in FP8 only (fp8_model_init); trains with --master_weights optimizer",
        resume=Resume.FREE,
        default=False,
        needs=(FP8,),
    )
    fp8_attention: bool = flag(
        "TE (--model_impl te): attention in FP8 too (cuDNN; recipe fp8_dpa); delayed on Hopper",
        resume=FP8_KNOB,
        default=False,
        needs=(
            FP8,
            When("model_impl", "te", why="runs TE's fused attention (te_linear and hf keep HF's)"),
        ),
    )
    fp8_lm_head: bool = flag(
        "the output layer's GEMMs in FP8 too (in the chunked loss, per-tensor current scaling; "
        "a tied embedding still reads the high-precision weight); opt-in, judge it by "
        "compare_runs' parity verdict",
        resume=FP8_KNOB,
        default=False,
        needs=When.because(
            "runs the output layer's GEMMs in FP8 inside the chunked loss",
            FP8,
            When("chunked_loss", words="--chunked_loss=1"),
        ),
    )
    bf16_layers: str = flag(
        "decoder layers kept in BF16 while FP8 is on: comma-separated indices, negative ones "
        "from the end (0,-1: the first and the last; a lone one as --bf16_layers=-1)",
        resume=FP8_KNOB,
        default="",
        needs=When.because("keeps layers out of FP8", FP8),
        excludes=When.because(
            "with --fp8_weights: a layer kept in BF16 needs high-precision weights, and "
            "--fp8_weights keeps every layer's only in FP8",
            When("fp8_weights"),
        ),
    )
    bf16_cooldown: float = flag(
        "the last fraction of --max_steps trains in BF16 (FP8 off from that step on, its "
        "validations too): a gap-closer for the schedule's end; 0: off",
        resume=FP8_KNOB,
        default=0.0,
        range=Range(low=0, high=1, high_open=True),
        needs=When.because("turns FP8 off for the last steps", FP8),
        excludes=(
            When("fp8_weights", why="with --fp8_weights: BF16 steps need high-precision weights"),
            When("fp8_all_gather", why="with --fp8_all_gather: BF16 steps gather no float8"),
            When("cuda_graphs", why="with --cuda_graphs: the graphs are captured with FP8 on"),
            When("fp8_numerics", why="with --fp8_numerics: BF16 steps cast nothing to FP8"),
        ),
    )
    fp8_all_gather: bool = flag(
        "torchao tensorwise: FSDP2 all-gathers weights in float8",
        resume=Resume.FREE,
        default=False,
        needs=(FP8,),
        excludes=When.because(
            "gathers FSDP2's weight shards in float8; --sharding_strategy none gathers nothing",
            UNSHARDED,
        ),
    )

    @property
    def name(self) -> str:
        return precision_name(self.fp8, self.bf16)


@dataclass(frozen=True)
class DataConfig:
    """What is read and in what batches; the two fingerprints are filled in by train.validate
    (what the tokenizer does, each local file's size and ends) so a resume sees a change."""

    tokenizer: str = flag(
        "HF tokenizer: hub name or local path (default: from --preset)", resume=KEPT, path=True
    )
    dataset: str = flag(
        "HF dataset hub name (streamed) or local file/folder", resume=KEPT, path=True
    )
    dataset_config_name: str | None = flag(
        "HF dataset config, e.g. 'en' for allenai/c4", resume=KEPT
    )
    text_column: str = flag(
        "column holding the document text", resume=KEPT, default="text", nonempty=True
    )
    train_batch_size: int = flag(
        "micro-batch per device (sequences)", resume=Resume.FREE, range=POSITIVE
    )
    val_batch_size: int = flag("default: --train_batch_size", resume=Resume.FREE, range=POSITIVE)
    verify_data: str = flag(
        "how a resume checks the local data files against the checkpoint's: sampled (size, "
        "ends and 16 blocks, ~1 MiB per file) or full (every byte: the whole dataset is read "
        "at each start; the checkpoints then record it; docs/data.md)",
        resume=Resume.FREE,
        default="sampled",
        choices=DATA_CHECKS,
    )
    tokenizer_sha256: str | None = derived(
        KEPT, words="the tokenizer's contents (sha256)", field_default=None
    )
    # The data files' fingerprint has its own rule and words (checkpoint/resume.py).
    data_fingerprint: dict[str, Any] | None = derived(Resume.LAUNCH, field_default=None)


@dataclass(frozen=True)
class OptimConfig:
    """AdamW, its master weights and the LR schedule, per optimizer step. The optimizer's state
    is stored in its own format (fp32 moments, or torchao's 8-bit / FP8 blocks; with
    --master_weights optimizer also the fp32 master copies beside bf16 parameters): a resume
    keeps the saved --optimizer and --master_weights."""

    grad_accum_steps: int = flag(
        "micro-batches per optimizer step", resume=Resume.FREE, default=1, range=POSITIVE
    )
    global_batch_size: int | None = flag(
        "sequences per optimizer step over all ranks: sets --grad_accum_steps for the ranks of "
        "each launch, so a resume on fewer nodes keeps the batch (torchtitan's)",
        resume=Resume.FREE,
        range=POSITIVE,
        excludes=When.because(
            "sets --grad_accum_steps itself", When("grad_accum_steps", test=(1).__ne__)
        ),
    )
    lr: float = flag("peak learning rate", resume=Resume.FREE, default=1e-3, range=POSITIVE)
    min_lr: float = flag(
        "learning rate at max_steps", resume=Resume.FREE, default=1e-4, range=NOT_NEGATIVE
    )
    warmup: int = flag(
        "linear warm-up steps (default: max_steps // 10, at most 10)",
        resume=KEPT,
        range=NOT_NEGATIVE,
    )
    lr_decay_style: str = flag(
        "decay from --lr to --min_lr after warm-up",
        resume=KEPT,
        default="cosine",
        choices=("cosine", "linear", "constant"),
    )
    optimizer: str = flag(
        "adamw: fp32 moments (8 bytes/param); adamw8bit, adamw_fp8: torchao's AdamW with "
        "8-bit / FP8 moments (~2 bytes/param)",
        resume=KEPT,
        default="adamw",
        choices=OPTIMIZERS,
        before=("adamw",),
    )
    master_weights: str = flag(
        "params: fp32 parameters, cast to bf16 for compute; optimizer: bf16 parameters, "
        "fp32 master copies in AdamW (TE's FusedAdam on CUDA with TE)",
        resume=KEPT,
        default="params",
        choices=MASTER_WEIGHTS,
        before=("params",),
        needs=When.because(
            "keeps bf16 parameters with fp32 copies in AdamW, and torchao's {optimizer} keeps "
            "none (torchao/optim/adam.py rounds each update into them)",
            When("optimizer", "adamw"),
        ),
        excludes=When.because(
            "stores the parameters in bf16, and --bf16=0 computes in fp32 (fp32 parameters "
            "are their own master weights)",
            When("bf16", False, words="--bf16=0"),
        ),
    )
    weight_decay: float = flag(
        "AdamW decay (not on norms/biases)", resume=KEPT, default=0.1, range=NOT_NEGATIVE
    )
    beta1: float = flag("AdamW first-moment decay", resume=KEPT, default=0.9, range=_BETA)
    beta2: float = flag("AdamW second-moment decay", resume=KEPT, default=0.95, range=_BETA)
    grad_clip: float = flag(
        "max global grad norm; 0 disables", resume=Resume.FREE, default=1.0, range=NOT_NEGATIVE
    )


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over ranks and what is traded for memory."""

    sharding_strategy: str = flag(
        "full: FSDP2 over all ranks; hybrid: shard in a node, replicate across; none: one "
        "process without FSDP2 (the whole model in place, bf16 by torch.autocast as torchtitan "
        "on one device: no per-step parameter copies)",
        resume=Resume.FREE,
        default="full",
        choices=SHARDING_STRATEGIES,
    )
    reshard_after_forward: str = flag(
        "FSDP2: default = all but the last layer and [norm, lm_head] (torchtitan); never = "
        "keep gathered for backward (no second gather and cast, more memory); always",
        resume=Resume.FREE,
        default="default",
        choices=RESHARD_POLICIES,
        excludes=When.because(
            "is an FSDP2 choice; --sharding_strategy none keeps the whole model in place",
            UNSHARDED,
        ),
    )
    reduce_dtype: str = flag(
        "FSDP2's gradient reduce-scatter: fp32, bf16, or fp8 (float8 blocks of 128 with fp32 "
        "scales, summed in fp32: ~1/4 of fp32's bytes; docs/cluster.md); judge it by "
        "compare_runs' parity verdict",
        resume=Resume.EXPERIMENT,
        default="fp32",
        choices=("fp32", "bf16", "fp8"),
        before=("fp32",),
        excludes=When.because("sets FSDP2's reduce; --sharding_strategy none has none", UNSHARDED),
    )
    activation_checkpointing: bool = flag(
        "recompute decoder layers in backward", resume=Resume.FREE, default=False
    )
    ac_every: int = flag(
        "with AC: recompute every Nth layer (2 = half)",
        resume=Resume.FREE,
        default=1,
        range=Range(low=1),
        needs=(AC,),
    )
    ac_scope: str = flag(
        "with AC: `layer` recomputes whole layers; `mlp` only their MLPs (on --model_impl te "
        "TE's LayerNormMLP recompute, TE >= 2.11, which skips fc2)",
        resume=Resume.FREE,
        default="layer",
        choices=AC_SCOPES,
        needs=(AC,),
    )
    compile: bool = flag("torch.compile each decoder layer", resume=Resume.FREE, default=False)
    cuda_graphs: bool = flag(
        "--model_impl te without FSDP2 (--sharding_strategy none) on a GPU: capture each decoder "
        "layer's forward and backward as CUDA graphs (TE's make_graphed_callables), one launch "
        "per layer instead of its kernels; not with --compile or --activation_checkpointing",
        resume=Resume.FREE,
        default=False,
        needs=When.because(
            "captures TE's decoder layers as CUDA graphs",
            When("model_impl", "te"),
            UNSHARDED,
            When("cuda", words="a CUDA GPU"),
            When("compile", False),
            When("activation_checkpointing", False),
            When("fp8_numerics", False),
        ),
    )
    chunked_loss: bool = flag(
        "lm_head + cross-entropy by chunks, no full logits; 0 = HF's",
        resume=Resume.FREE,
        default=True,
    )
    preflight: str = flag(
        "time the job's all-gathers and reduce-scatters (the largest FSDP unit; within nodes, "
        "across nodes, each link) before step 1, name a slow node or link, keep the bus "
        "bandwidths in <output_dir>/preflight.json (docs/cluster.md); auto = bf16 only, on "
        "jobs of 2+ nodes (seconds); full = bf16, fp8 and fp32 payloads on any multi-rank job",
        resume=Resume.LAUNCH,
        default="auto",
        choices=("auto", "full", "off"),
    )
    dist_timeout: int = flag(
        "seconds before a stuck collective fails",
        resume=Resume.FREE,
        default=600,
        range=(
            POSITIVE,
            Range(
                high=MAX_DIST_TIMEOUT_S,
                words=f"{{flag}} must be <= {MAX_DIST_TIMEOUT_S} s (30 days), got {{value}}",
            ),
        ),
    )


@dataclass(frozen=True)
class CheckpointConfig:
    """Where checkpoints go, when, how many stay; what a start resumes or imports; the export.
    Where and how this launch starts is no part of the run a checkpoint belongs to."""

    checkpoint_dir: str = flag("default <output_dir>/checkpoints", resume=Resume.LAUNCH, path=True)
    checkpoint_freq: int = flag(
        "steps between checkpoints; 0 = at the end only; -1 = none (a preemption "
        "signal still saves)",
        resume=Resume.FREE,
        default=0,
        range=Range(low=-1),
    )
    keep_last: int = flag(
        "checkpoints kept; 0 keeps all", resume=Resume.FREE, default=2, range=NOT_NEGATIVE
    )
    async_checkpoint: bool = flag(
        "write checkpoints in the background",
        resume=Resume.FREE,
        default=False,
        needs=When.because(
            "cannot save --optimizer {optimizer}'s states: DCP's async stager copies them with "
            "aten.new_empty, which torchao's OptimState8bit/Fp8 do not implement "
            "(torchao/optim/subclass_8bit.py)",
            When("optimizer", "adamw"),
        ),
    )
    resume_from_checkpoint: str | None = flag(
        "PATH or 'auto' (newest in checkpoint_dir)", resume=Resume.LAUNCH, path=True
    )
    overwrite_output_dir: bool = flag(
        "start afresh where an earlier run left checkpoints: they are deleted at start-up "
        "(without it such a run is refused)",
        resume=Resume.LAUNCH,
        default=False,
        excludes=When.because(
            "deletes the checkpoints --resume_from_checkpoint would resume from",
            When("resume_from_checkpoint", test=lambda path: path is not None),
        ),
    )
    allow_data_change: bool = flag(
        "resume although a local --dataset file changed since the checkpoint was saved (its "
        "saved position then points into other text; without it such a resume is refused)",
        resume=Resume.LAUNCH,
        default=False,
    )
    init_from_hf: str | None = flag(
        "start from a Hugging Face checkpoint dir (a Llama or Mistral)",
        resume=Resume.LAUNCH,
        path=True,
    )
    export_hf: str | None = flag(
        "write the final model as HF safetensors to this dir", resume=Resume.LAUNCH, path=True
    )


SEED_RANGE = Range(
    low=0, high=MAX_SEED, high_open=True, words="{flag} must be in [0, 2**63), got {value}"
)


@dataclass(frozen=True)
class RunConfig:
    """The run itself: its length, seed, reports, validation and folder, and what observes it
    (profiler traces, memory snapshots). The observation flags read back as off from records
    that lack them, and a resume may change them."""

    max_steps: int = flag("optimizer steps", resume=Resume.FREE, default=100, range=POSITIVE)
    seed: int = flag(
        "model init and RNG streams; the data order too, unless --data_seed",
        resume=KEPT,
        default=42,
        range=SEED_RANGE,
    )
    logging_freq: int = flag(
        "steps between log lines", resume=Resume.FREE, default=1, range=POSITIVE
    )
    validation_freq: int = flag(
        "steps between validations; 0 = end only",
        resume=Resume.FREE,
        default=0,
        range=NOT_NEGATIVE,
    )
    # Every run validates at its end (--validation_freq 0: only there), so at least one batch.
    validation_batches: int = flag(
        "held-out batches per validation", resume=Resume.FREE, default=4, range=POSITIVE
    )
    output_dir: str = flag(
        "run directory (default runs/<preset>-<precision>, or runs/<--init_from_hf folder name>-"
        "<precision>)",
        resume=Resume.LAUNCH,
        path=True,
    )
    tensorboard: bool = flag(
        "the same as --tracker tensorboard: TensorBoard scalars in <output_dir>/tensorboard "
        "(rank 0), one of the run's trackers",
        resume=Resume.FREE,
        default=False,
    )
    fp8_numerics: bool = flag(
        "at report steps, per FP8 linear: amax, scale, underflow and saturation shares of its "
        "input, weight and gradient, to metrics.jsonl and the trackers (torchao recipes, or TE "
        "delayed/current; on --model_impl te through TE's debug tools, nvdlfw-inspect)",
        resume=Resume.FREE,
        default=False,
        needs=When.because("measures FP8 casts", FP8),
        excludes=(
            When(
                "fp8_all_gather",
                why="with --fp8_all_gather: the weights arrive in float8, with no bf16 to measure",
            ),
        ),
    )
    validate_only: bool = flag(
        "check flags, data, tokenizer, checkpoint and the folders it writes (a probe file, "
        "removed), then exit: 0 ready, 2 bad input (the launcher runs this once before torchrun)",
        resume=Resume.LAUNCH,
        default=False,
    )
    profile_steps: str | None = flag(
        "torch.profiler traces of steps START..END (inclusive; one warm-up step before), "
        "on every rank: <output_dir>/profile/step_START/rank_R.pt.trace.json.gz; read them "
        "with `.venv/bin/python -m analysis.step_breakdown RUN...` (default: off)",
        resume=Resume.FREE,
        metavar="START:END",
        field_default=None,
    )
    data_seed: int | None = flag(
        "the data order's seed (default: --seed): BF16 replicas for compare_runs' noise band "
        "differ in --seed alone and keep this, so they read the same tokens",
        resume=KEPT,
        range=SEED_RANGE,
        before=(None,),
        field_default=None,
    )
    memory_snapshot_step: int | None = flag(
        "CUDA only: record the caching allocator's history and dump a snapshot after step "
        "N and at an out-of-memory error (0: at an OOM only) to <output_dir>/memory/; open it "
        "at https://pytorch.org/memory_viz (default: off)",
        resume=Resume.FREE,
        metavar="N",
        needs=When.because(
            "records CUDA's caching allocator (on CPU, --profile_steps still traces the steps)",
            When("cuda", words="a CUDA GPU"),
        ),
        field_default=None,
    )
    slow_rank_threshold: float = flag(
        "at report steps, a W line names the rank (and node) whose busy time per step is "
        "more than RATIO x the ranks' median (docs/hangs.md); 0 = off",
        resume=Resume.FREE,
        default=1.5,
        range=Range(
            low=1,
            low_open=True,
            off=0,
            words="{flag} is a ratio to the median step time: > 1, or 0 for off; got {value:g}",
        ),
        metavar="RATIO",
        field_default=1.5,
    )
    hang_timeout: float | None = flag(
        "no step done for SECONDS: every rank writes its Python stacks to "
        "<output_dir>/hang/ and exits (docs/hangs.md); default 20x the measured step time, at "
        "least 300 s; 0 = off",
        resume=Resume.FREE,
        range=Range(low=1, off=0, words="{flag} must be >= 1 seconds (0: off), got {value:g}"),
        metavar="SECONDS",
        field_default=None,
    )
    tracker: str = flag(
        "experiment trackers fed from rank 0 at report steps: "
        f"{', '.join(row.name for row in TRACKERS)} (tensorboard = --tensorboard); a resume "
        "continues the same tracker runs; see docs/trackers.md (default: none)",
        resume=Resume.FREE,
        default="",
        metavar="NAME[,NAME]",
        field_default="",
    )


#: Section name -> its type, in the pipeline's order (docs/flags.md's groups follow it).
SECTIONS: dict[str, type] = {
    "model": ModelShape,
    "precision": PrecisionConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "parallel": ParallelConfig,
    "checkpoint": CheckpointConfig,
    "run": RunConfig,
}


#: Section fields no flag sets: a preset or --init_from_hf's config.json fills in the model's,
#: train.validate the data's fingerprints.
DERIVED = frozenset(
    f.name for kind in SECTIONS.values() for f in fields(kind) if not spec_of(f).is_flag
)


def flag_fields(kind: type) -> tuple[str, ...]:
    """A section's fields that are flags, in its order (and the parser's)."""
    return tuple(f.name for f in fields(kind) if f.name not in DERIVED)
