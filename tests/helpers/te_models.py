"""Small models on the TE test double (the te_double fixture installs it): a config, the
backend's resolved flags, a batch, and a model built as sharded training builds it."""

from __future__ import annotations

import torch
from transformers import LlamaConfig

import te_llama
from model_utils.config.run_config import Config
from model_utils.model.modeling import materialize


def tiny_config(**overrides) -> LlamaConfig:
    values = dict(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def backend_args(fp8: bool, recipe: str = "delayed", impl: str = "te", **overrides):
    """Every flag at its default (as the parser and the tiny preset give it), then these: a
    backend reads only resolved configs, whose fields all exist."""
    from model_utils.config.arguments import apply_preset, build_parser

    values = vars(apply_preset(build_parser().parse_args([])))
    values.update(
        fp8=fp8,
        fp8_recipe=recipe,
        fp8_format="hybrid",
        amax_history_len=16,
        amax_compute_algo="max",
        fp8_margin=0,
        fp8_weights=False,
        fp8_attention=False,
        model_impl=impl,
    )
    values.update(overrides)
    return Config.from_flat(values)


def batch(config: LlamaConfig, seed: int = 0, size: tuple[int, int] = (2, 32)) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, size, generator=torch.Generator().manual_seed(seed))


def built(config: LlamaConfig, impl: str = "te", seed: int = 0, **kwargs) -> torch.nn.Module:
    """Meta build -> to_empty -> init, the lead's flow for sharded training."""
    with torch.device("meta"):
        model = te_llama.build_te_llama(config, impl=impl, **kwargs)
    materialize(model, torch.device("cpu"), seed)
    return model
