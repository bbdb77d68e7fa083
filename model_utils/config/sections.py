"""The resolved run config: one typed, frozen section per pipeline stage.

The command line keeps the upstream recipe's flat flag names (`--hidden_width`, `--fp8`, `--lr`);
each flag is the field of the same name in exactly one section, so `--lr` is `config.optim.lr`
and a stage is handed its own section, not the whole run. Records (checkpoint.json's config,
metrics.jsonl's run record) keep the flat names (:meth:`Config.as_dict`), so the runs of every
version of the recipe compare and resume alike.

    section      type              read by
    model        ModelShape        model/ (the Llama), run/metrics (FLOPs), checkpoint/ (HF in/out)
    precision    PrecisionConfig   precision/ (the backend), model/ (which implementation)
    data         DataConfig        data/ (tokenizer, corpus, micro-batches)
    optim        OptimConfig       optim.py (AdamW, LR schedule), run/step (accumulation, clip)
    parallel     ParallelConfig    parallel/ (FSDP2, AC, compile), model/loss (chunked)
    checkpoint   CheckpointConfig  checkpoint/ (save, resume, HF import/export)
    run          RunConfig         train.py and run/ (steps, seed, logs, validation, run folder)

The checks between flags live in one place, config/flag_rules.py, before the sections are built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from model_utils.config.argv import precision_name

#: The model's size: what FLOPs, a checkpoint's tensors and a like-for-like comparison hang on
#: (ModelShape's first fields).
SHAPE_FIELDS = (
    "hidden_width",
    "num_layers",
    "num_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
)
#: Our shape names -> the keys of a Hugging Face Llama config.json: the one mapping table, read
#: by model/modeling.llama_config (our shape -> LlamaConfig) and config/hf_config (config.json ->
#: our shape) and checkpoint/hf.py (a file that does not fit, in flag words).
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
}


@dataclass(frozen=True)
class ModelShape:
    """The Llama's shape and positions: what FLOPs, a checkpoint's tensors and a like-for-like
    comparison hang on. The last three come from the preset or the HF config.json, not flags.

    ``tie_word_embeddings``: one matrix is both the input embedding and the output projection
    (Llama 3.2 1B/3B), trained as one parameter; a tied and an untied model are different
    models, with different checkpoints."""

    hidden_width: int
    num_layers: int
    num_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_context_width: int
    rope_theta: float
    tie_word_embeddings: bool = False
    rms_norm_eps: float = 1e-5
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_width // self.num_heads


@dataclass(frozen=True)
class PrecisionConfig:
    """BF16 or FP8, the implementation that computes it, and the FP8 recipe's knobs: the
    fields a resume of the same run may not change (checkpoint/resume.py)."""

    model_impl: str
    fp8: bool
    bf16: bool
    fp8_recipe: str | None
    fp8_format: str
    amax_history_len: int
    amax_compute_algo: str
    fp8_margin: int
    fp8_weights: bool
    fp8_attention: bool
    fp8_all_gather: bool

    @property
    def name(self) -> str:
        return precision_name(self.fp8, self.bf16)


@dataclass(frozen=True)
class DataConfig:
    """What is read and in what batches; the two fingerprints are filled in by train.validate
    (what the tokenizer does, each local file's size and ends) so a resume sees a change."""

    tokenizer: str
    dataset: str
    dataset_config_name: str | None
    text_column: str
    train_batch_size: int
    val_batch_size: int
    tokenizer_sha256: str | None = None
    data_fingerprint: dict[str, Any] | None = None


@dataclass(frozen=True)
class OptimConfig:
    """AdamW, its master weights and the LR schedule, per optimizer step."""

    grad_accum_steps: int
    lr: float
    min_lr: float
    warmup: int
    lr_decay_style: str
    optimizer: str
    master_weights: str
    weight_decay: float
    beta1: float
    beta2: float
    grad_clip: float


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over ranks and what is traded for memory."""

    sharding_strategy: str
    reshard_after_forward: str
    activation_checkpointing: bool
    ac_every: int
    ac_scope: str
    compile: bool
    chunked_loss: bool
    dist_timeout: int


@dataclass(frozen=True)
class CheckpointConfig:
    """Where checkpoints go, when, how many stay; what a start resumes or imports; the export."""

    checkpoint_dir: str
    checkpoint_freq: int
    keep_last: int
    async_checkpoint: bool
    resume_from_checkpoint: str | None
    overwrite_output_dir: bool
    allow_data_change: bool
    init_from_hf: str | None
    export_hf: str | None


@dataclass(frozen=True)
class RunConfig:
    """The run itself: its length, seed, reports, validation and folder, and what observes it
    (profiler traces, memory snapshots)."""

    max_steps: int
    seed: int
    logging_freq: int
    validation_freq: int
    validation_batches: int
    output_dir: str
    tensorboard: bool
    validate_only: bool
    # Observation only (a resume may change them); None: off. Records older than the flags
    # read back with them off.
    profile_steps: str | None = None  # "START:END", steps START..END inclusive
    memory_snapshot_step: int | None = None  # 0: at an out-of-memory error only
    slow_rank_threshold: float = 1.5  # slowest/median busy time per step; 0: off
    hang_timeout: float | None = None  # None: from the measured step time; 0: off
    tracker: str = ""  # comma list of wandb, mlflow, tensorboard (run/trackers.py)


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
#: The fields of the run itself, beside the sections: what it was built from.
TOP_FIELDS = ("recipe", "preset")
#: Section fields no flag sets: a preset or --init_from_hf's config.json fills in the model's,
#: train.validate the data's fingerprints.
DERIVED = frozenset(
    {
        "rms_norm_eps",
        "rope_scaling",
        "max_position_embeddings",
        "tokenizer_sha256",
        "data_fingerprint",
    }
)


def flag_fields(kind: type) -> tuple[str, ...]:
    """A section's fields that are flags, in its order (and the parser's)."""
    return tuple(f.name for f in fields(kind) if f.name not in DERIVED)


#: Flat field name -> its section.
SECTION_OF: dict[str, str] = {
    f.name: section for section, kind in SECTIONS.items() for f in fields(kind)
}


@dataclass(frozen=True)
class Config:
    """The run's config, resolved once (preset filled in, --model_impl auto and the FP8 recipe
    decided) and frozen: every stage reads the same values, and the records say what the run
    really used. A change (a resume's lr) is a new object from :meth:`replace`."""

    recipe: str | None
    preset: str
    model: ModelShape
    precision: PrecisionConfig
    data: DataConfig
    optim: OptimConfig
    parallel: ParallelConfig
    checkpoint: CheckpointConfig
    run: RunConfig

    @classmethod
    def from_flat(cls, values: Mapping[str, Any]) -> Config:
        """The sections from flat flag names (a parsed command line, a saved record); a name
        that belongs nowhere is an error: a flag must not be read by no one."""
        unknown = sorted(set(values) - set(SECTION_OF) - set(TOP_FIELDS))
        if unknown:
            raise AttributeError(f"no config section has field(s): {', '.join(unknown)}")
        parts: dict[str, Any] = {name: values.get(name) for name in TOP_FIELDS}
        for section, kind in SECTIONS.items():
            given = {f.name: values[f.name] for f in fields(kind) if f.name in values}
            parts[section] = kind(**given)
        return cls(**parts)

    def as_dict(self) -> dict[str, Any]:
        """Every field under its flat flag name, as a new dict (checkpoint.json, metrics.jsonl)."""
        flat: dict[str, Any] = {name: getattr(self, name) for name in TOP_FIELDS}
        for section in SECTIONS:
            flat.update(dataclasses.asdict(getattr(self, section)))
        return flat

    @property
    def model_source(self) -> str:
        """What the model built is, in the words the user gave: `--init_from_hf DIR (N layers,
        hidden H)` for a checkpoint's config.json, else `--preset NAME` (the lines describing
        a run said `tiny`, the default preset, for a Llama 3 8B loaded from a folder)."""
        if self.checkpoint.init_from_hf:
            shape = self.model
            return (
                f"--init_from_hf {self.checkpoint.init_from_hf} ({shape.num_layers} layers, "
                f"hidden {shape.hidden_width})"
            )
        return f"--preset {self.preset}"

    def get(self, name: str) -> Any:
        """One field by its flat flag name (code that walks a list of flags, e.g. resume.py)."""
        if name in TOP_FIELDS:
            return getattr(self, name)
        return getattr(getattr(self, SECTION_OF[name]), name)

    def replace(self, **changes: Any) -> Config:
        """A copy with `changes`, by flat flag name; only existing fields (a typo must not add
        a new one)."""
        unknown = sorted(set(changes) - set(SECTION_OF) - set(TOP_FIELDS))
        if unknown:
            raise AttributeError(f"no such config field: {', '.join(unknown)}")
        return Config.from_flat({**self.as_dict(), **changes})
