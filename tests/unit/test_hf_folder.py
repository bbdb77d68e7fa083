"""The HF folder an export writes beside its weights (checkpoint.hf), in this process: the config is
the model's own (shape, RoPE scaling, max_position_embeddings) with the tokenizer's ids, the
architecture and the KV cache on; generation_config.json; the tokenizer itself; and the folder's
other files are published before its weights, never after them. The clients (transformers,
lm-eval-harness) on a trained run's folder: tests/integration/test_hf_export_client.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.runs import SMALL_LLAMA

from model_utils import checkpoint as ck
from model_utils.checkpoint.hf import existing_model

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def run_tokenizer():
    from model_utils import data
    from model_utils.config.presets import BUNDLED_TOKENIZER

    return data.load_tokenizer(BUNDLED_TOKENIZER)


def scaled_model():
    """A small Llama built as the run builds it, with Llama 3.2's RoPE scaling and a context
    far beyond the run's window."""
    from transformers import LlamaForCausalLM

    from model_utils.config import arguments
    from model_utils.model import modeling

    args = arguments.parse_args(SMALL_LLAMA)
    args = args.replace(rope_scaling=LLAMA3_SCALING, max_position_embeddings=131072)
    return LlamaForCausalLM(modeling.model_config(args.model))


def test_the_export_is_the_models_config_with_the_tokenizers_ids(tmp_path: Path) -> None:
    """Before: bos 1 / eos 2 (LlamaConfig's defaults) for a tokenizer whose only special token
    is id 0, no architectures, use_cache false, no generation_config.json, no tokenizer."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from model_utils import data

    model, tokenizer = scaled_model(), run_tokenizer()
    ck.export_hf(model, model.config, tmp_path / "hf", tokenizer)
    config = AutoConfig.from_pretrained(tmp_path / "hf")
    assert config.rope_parameters == {**LLAMA3_SCALING, "rope_theta": 10000.0}
    assert config.max_position_embeddings == 131072
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (0, 0, 0)
    assert config.architectures == ["LlamaForCausalLM"] and config.use_cache is True
    assert model.config.use_cache is False and model.config.architectures is None  # a copy
    generation = GenerationConfig.from_pretrained(tmp_path / "hf")
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (0, 0, 0)
    exported = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert data.tokenizer_fingerprint(exported) == data.tokenizer_fingerprint(tokenizer)


def test_a_tokenizer_with_its_own_pad_token_keeps_it() -> None:
    from model_utils.checkpoint import hf

    tokenizer = run_tokenizer()
    assert hf.token_ids(tokenizer) == {
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
    }
    tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
    assert hf.token_ids(tokenizer)["pad_token_id"] == len(tokenizer) - 1


def test_the_other_files_are_staged_and_published_before_the_weights(tmp_path: Path) -> None:
    """Until finish(), the folder shows hidden entries only (a reader sees no config without
    weights, nor weights without their config or tokenizer); an export cut short leaves them
    hidden, and the next export removes them."""
    from model_utils.checkpoint import hf

    out = tmp_path / "hf"
    model = scaled_model()
    cut_short = hf.SafetensorsShardWriter(out)
    hf.write_model_files(cut_short.staging, model.config, run_tokenizer(), torch.float32)
    cut_short.add("x", torch.ones(4))
    cut_short._flush()
    assert all(p.name.startswith(hf.PART_PREFIX) for p in out.iterdir())
    assert existing_model(out) == []

    writer = hf.SafetensorsShardWriter(out)
    assert list(out.iterdir()) == []  # the stale parts and staged files are gone
    hf.write_model_files(writer.staging, model.config, run_tokenizer(), torch.float32)
    writer.add("x", torch.ones(4))
    writer.finish()
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 0
