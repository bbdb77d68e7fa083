"""What a Hugging Face model folder holds beside its weights, so that a client needs no hand
help: `AutoModelForCausalLM.from_pretrained(d)`, `AutoTokenizer.from_pretrained(d)` and
`generate` (or lm-eval-harness) take everything from the folder.

- the run's tokenizer (its own files, saved by `save_pretrained`);
- config.json with the token ids of that tokenizer (transformers' LlamaConfig defaults are
  bos 1 / eos 2, which name other tokens in most tokenizers: `generate` would stop on the wrong
  one), the architecture (AutoModel* reads it), and `use_cache: true` (training turns the KV
  cache off; generation wants it);
- generation_config.json with the same ids (pad = eos when the tokenizer has no pad token, as
  `generate` would otherwise warn and guess).

Shape, RoPE and `max_position_embeddings` are the model config's own, as the run built it.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

ARCHITECTURES = {"llama": "LlamaForCausalLM"}
GENERATION_CONFIG = "generation_config.json"


def token_ids(tokenizer: Any) -> dict[str, int | None]:
    """bos/eos/pad ids as the tokenizer defines them; pad falls back to eos (a tokenizer trained
    for pre-training, like the bundled one, has no pad token)."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos, "pad_token_id": pad}


def client_config(config: Any, tokenizer: Any, dtype: torch.dtype) -> Any:
    """A copy of the run's model config for clients: weights' dtype, the tokenizer's ids, the
    architecture, the KV cache on. Every shape and RoPE field is left as the run built it."""
    config = copy.deepcopy(config)
    config.dtype = dtype
    config.use_cache = True
    architecture = ARCHITECTURES.get(getattr(config, "model_type", "llama"), "LlamaForCausalLM")
    config.architectures = [architecture]
    for name, value in token_ids(tokenizer).items():
        setattr(config, name, value)
    return config


def generation_config(tokenizer: Any) -> Any:
    """generate()'s defaults: the tokenizer's ids, nothing else (greedy, the model's length)."""
    from transformers import GenerationConfig

    return GenerationConfig(**token_ids(tokenizer))


def write_model_files(out_dir: Path, config: Any, tokenizer: Any, dtype: torch.dtype) -> None:
    """config.json, generation_config.json and the tokenizer's files into `out_dir` (the export's
    staging folder: they are published with the weights, see SafetensorsShardWriter)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    client_config(config, tokenizer, dtype).save_pretrained(str(out_dir))
    generation_config(tokenizer).save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
