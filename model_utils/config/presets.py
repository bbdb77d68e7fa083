"""Model presets: the published Llama shapes (and a tiny Mistral), each with its data and context.

A preset fills every field in PRESET_FIELDS that the user did not set (arguments.apply_preset);
an explicit flag always wins. Kept apart from the flags so the shapes read as a table.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from model_utils.config.sections import DERIVED, ModelShape

# The bundled data's one source. It lives with the presets (not in model_utils/data) so parsing
# flags never imports the data stack. The paths are absolute so the recipe runs from any working
# directory (Slurm jobs often start elsewhere).
_DATA_DIR = Path(__file__).resolve().parents[2] / "data"
BUNDLED_DATASET = str(_DATA_DIR / "kjv.jsonl.gz")
BUNDLED_TOKENIZER = str(_DATA_DIR / "tokenizer")


@dataclass(frozen=True)
class Preset(ModelShape):
    """A model shape (config/sections.py's ModelShape, field for field) with the training data
    and context it was published with."""

    tokenizer: str = BUNDLED_TOKENIZER
    dataset: str = BUNDLED_DATASET
    dataset_config_name: str | None = None
    train_batch_size: int = 1


_TINY = {"vocab_size": 8192, "max_context_width": 256, "rope_theta": 10000.0, "train_batch_size": 8}
_C4 = {"dataset": "allenai/c4", "dataset_config_name": "en"}
_LLAMA2 = {
    "vocab_size": 32000,
    "rope_theta": 10000.0,
    "max_context_width": 4096,
    "tokenizer": "hf-internal-testing/llama-tokenizer",
    **_C4,
}
_LLAMA3 = {
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "max_context_width": 8192,
    "tokenizer": "NousResearch/Meta-Llama-3-8B",
    **_C4,
}
_LLAMA31_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_LLAMA31 = {**_LLAMA3, "rope_scaling": _LLAMA31_SCALING, "max_position_embeddings": 131072}
_LLAMA32 = {
    **_LLAMA31,
    "rope_scaling": {**_LLAMA31_SCALING, "factor": 32.0},
    "tie_word_embeddings": True,
}

# Shapes are the published ones (Llama 2 paper / Meta model cards); `tiny` is ours, for CPUs.
PRESETS: dict[str, Preset] = {
    "tiny": Preset(256, 4, 4, 2, 688, **_TINY),
    "tiny-mistral": Preset(256, 4, 4, 2, 688, **_TINY, model_family="mistral"),  # no window
    "llama2-7b": Preset(4096, 32, 32, 32, 11008, **_LLAMA2),
    "llama2-13b": Preset(5120, 40, 40, 40, 13824, **_LLAMA2),
    "llama2-70b": Preset(8192, 80, 64, 8, 28672, **_LLAMA2),
    "llama3-8b": Preset(4096, 32, 32, 8, 14336, **_LLAMA3),
    "llama3-70b": Preset(8192, 80, 64, 8, 28672, **_LLAMA3),
    "llama3.1-8b": Preset(4096, 32, 32, 8, 14336, **_LLAMA31),
    # Llama 3.2: 128K context from 8K by RoPE scaling (factor 32), input and output embeddings
    # tied (one 128256 x hidden matrix).
    "llama3.2-1b": Preset(2048, 16, 32, 8, 8192, **_LLAMA32),
    "llama3.2-3b": Preset(3072, 28, 24, 8, 8192, **_LLAMA32),
}

#: Flags a preset provides (a Preset's fields that a flag sets); their flags default to None so
#: we can tell "not given" from "given".
PRESET_FIELDS = tuple(f.name for f in fields(Preset) if f.name not in DERIVED)
