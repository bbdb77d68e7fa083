"""Checkpoints: DCP save/load with atomic publish, keep-last-k, auto-resume; HF safetensors in/out.

Layout of a checkpoint directory::

    <checkpoint_dir>/step_00000100/        a published, complete checkpoint
        .metadata, __0_0.distcp, ...       torch.distributed.checkpoint (DCP) files, one per rank
        checkpoint.json                    the marker: step, world size, run and model config,
                                           and every file's size and sha256
    <checkpoint_dir>/.tmp-step_00000200/   being written (or left by a crash): never resumed from
    <checkpoint_dir>/damaged-step_00000300/  failed its checks at an `auto` resume (or lost its
                                           .metadata or marker): set aside, kept for a look
    <checkpoint_dir>/unverified-step_00000400/  no checksum for every file (saved before them,
                                           or the table removed), newer than the checkpoint an
                                           `auto` resume took: set aside; loads only by name

Why the temporary name: DCP writes one file per rank and then `.metadata`; a job killed in the
middle leaves a directory that looks like a checkpoint but is not one. Every rank writes into
`.tmp-step_N`; when the save has finished everywhere, rank 0 writes `checkpoint.json` and renames
the directory to `step_N` (one atomic rename). Only names `step_N` holding both `.metadata` and
`checkpoint.json` count as complete. Stale `.tmp-*` directories are removed before the next save.
Before the rename each rank sums the files it wrote and rank 0 records the sums in the marker; a
resume checks them (the ranks split the files) and refuses, or with `auto` skips, a checkpoint
whose bytes changed since (`Checkpointer.resolve_intact`).

What is saved (one DCP state dict of Stateful items, see `TrainState`):
    model      FSDP2 DTensor shards (get_model_state_dict): resharded by DCP on load
    optimizer  AdamW state keyed by parameter name (get_optimizer_state_dict): resharded too
               (torchao's 8-bit/FP8 states as its own tensor subclasses; a reshard that would
               cut one of their blocks is refused: low_bit_reshard_problem)
    scheduler  LR scheduler state_dict (identical on every rank)
    progress   step and the run's config as JSON
    data       per rank: `data.rank{r}`, this rank's data-stream position
    rng        per rank: `rng.rank{r}`, python/numpy/torch(/cuda) generator states

Per-rank items need per-rank keys: DCP de-duplicates non-tensor values written under the same key
by several ranks and keeps only one copy (torch/distributed/checkpoint/_dedup_save_plans.py), so
a shared key `data` would silently restore rank k's position on every rank. Each per-rank value is
packed into bytes so DCP stores it as one opaque object, whatever tensors it contains.

World-size changes: model and optimizer reshard. Per-rank positions cannot be mapped (rank r of 2
and rank r of 1 read different shards), so a resharded load skips `data` and `rng`, reseeds the
generators from (seed, step, rank), and calls `TrainState.on_data_reshard(step, saved_states)`
if given (saved_states[r] = what rank r saved; e.g. move the stream to a position derived from
them or from the step); without it the stream keeps its fresh position (the beginning of this
rank's new shard). Both cases log a warning.

Implementation changes: --model_impl hf and te_linear share Hugging Face parameter names; te
fuses each decoder layer (QKV in one weight, gate/up in fc1). A checkpoint of the other layout is
converted on load by the Checkpointer's `state_dict_adapter` (te_llama.StateDictAdapter, from
te_llama's mapping table; `load_converted`): each decoder layer is read whole into plain tensors
(DCP assembles them from the saved shards), mapped, and each rank copies its block into its
DTensor shards, so no rank holds more than one layer. AdamW's moments
have their parameter's shape and go through the same table. TE's `_extra_state` (FP8 scaling
history) belongs to TE's module structure and is not converted: it starts fresh, as does the
extra state a te_linear run finds missing in a checkpoint of --model_impl hf.

The package, one job per module:
    manifest.py         names, marker, completeness, checksums, which checkpoint to resume
    compat.py           which run a checkpoint belongs to (flags a resume must keep)
    errors.py           why a checkpoint cannot be used or written, in one line
    stateful.py         the Stateful items DCP saves and loads; TrainState, LoadResult
    checkpointer.py     Checkpointer: save, atomic publish, prune, verified resume, load
    convert.py          loading a checkpoint of the other parameter layout
    optimizer_state.py  saved optimizer fields; torchao block-quantized state and resharding
    saved.py            reading saved tensors whole in one process
    tensors.py          full tensors <-> this rank's shards, one decoder layer at a time
    hf_import.py        --init_from_hf (safetensors in)
    hf_export.py        --export_hf and checkpoint -> HF directory (safetensors out)
    ranks.py            rank, world size and the few collectives the above need

Public API: what code outside the package uses (train.py, run/guards.py,
scripts/convert_checkpoint.py). Everything else is imported from its module, as the tests of
internals and the benchmarks do::

    Checkpointer, TrainState                 save, atomic publish, prune, verified resume, load
    check_before_start, resume_or_start      the resume policy, before / after the process group
    check_resume_arg, check_hf_dir,          validate: --resume_from_checkpoint, --init_from_hf,
    check_export_dir                         --export_hf
    export_hf, load_hf_weights               HF safetensors out and in
    CheckpointWriteError, ResumeRefused,     why a checkpoint cannot be used or written
    UntrustedCheckpointError,
    write_error_reason
    check_fp8_state_loadable                 validate (TE): a resume's pickled FP8 state
    read_marker                              a checkpoint's marker (the converter)
    complete_checkpoints,                    the converter: which checkpoint, and is it
    checkpoint_problem, checkpoint_damage,   complete, intact and verified
    content_damage, unverified_reason,
    recorded_sums
    dcp_to_hf, export_dir_problem,           the converter: checkpoint -> HF folder, and
    PART_PREFIX, remove_path                 removing what a failed export wrote
"""

from model_utils.checkpoint.checkpointer import Checkpointer
from model_utils.checkpoint.errors import (
    CheckpointWriteError,
    ResumeRefused,
    UntrustedCheckpointError,
    write_error_reason,
)
from model_utils.checkpoint.hf_export import (
    PART_PREFIX,
    check_export_dir,
    dcp_to_hf,
    export_dir_problem,
    export_hf,
    remove_path,
)
from model_utils.checkpoint.hf_import import check_hf_dir, load_hf_weights
from model_utils.checkpoint.manifest import (
    check_resume_arg,
    checkpoint_damage,
    checkpoint_problem,
    complete_checkpoints,
    content_damage,
    read_marker,
    recorded_sums,
    unverified_reason,
)
from model_utils.checkpoint.resume import (
    check_before_start,
    check_fp8_state_loadable,
    resume_or_start,
)
from model_utils.checkpoint.stateful import TrainState

__all__ = [
    "PART_PREFIX",
    "CheckpointWriteError",
    "Checkpointer",
    "ResumeRefused",
    "TrainState",
    "UntrustedCheckpointError",
    "check_before_start",
    "check_fp8_state_loadable",
    "check_export_dir",
    "check_hf_dir",
    "check_resume_arg",
    "checkpoint_damage",
    "checkpoint_problem",
    "complete_checkpoints",
    "content_damage",
    "dcp_to_hf",
    "export_dir_problem",
    "export_hf",
    "load_hf_weights",
    "read_marker",
    "recorded_sums",
    "remove_path",
    "resume_or_start",
    "unverified_reason",
    "write_error_reason",
]
