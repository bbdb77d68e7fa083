"""Checkpoints: DCP save/load with atomic publish, keep-last-k, verified auto-resume and the
resume policy; Hugging Face safetensors in and out. The layout on disk, what is saved, resharding
and cross-implementation loads: docs/checkpoints.md.

    published.py     what a complete checkpoint is (standard library: the launcher's rule too)
    manifest.py      names, marker, checksums, the one verdict (inspect_checkpoint), the one
                     resolver (checkpoint_to_resume), publish and prune, why a checkpoint
                     cannot be used or written, the ranks' few collectives
    checkpointer.py  Checkpointer (save, atomic publish, load), TrainState and its items
    resume.py        the resume policy: which run a checkpoint belongs to, and its refusals
    layout.py        full tensors <-> shards, saved tensors read whole, optimizer state,
                     loads from the other parameter layout
    hf.py            --init_from_hf, --export_hf, checkpoint -> HF folder

The names below are what train.py, run/guards.py and scripts/convert_checkpoint.py use; the rest
is imported from its module.
"""

from model_utils.checkpoint.checkpointer import Checkpointer, TrainState
from model_utils.checkpoint.hf import check_export_dir, check_hf_dir, export_hf, load_hf_weights
from model_utils.checkpoint.manifest import (
    CheckpointWriteError,
    ResumeRefused,
    check_resume_arg,
    checkpoint_to_resume,
    complete_checkpoints,
    inspect_checkpoint,
    read_marker,
)
from model_utils.checkpoint.resume import check_before_start, resume_or_start
