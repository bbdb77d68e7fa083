"""Build the model (config/families.py's row) on the meta device and initialise it by shards.

The model is never built in full on any rank: `build` returns parameters on the meta device,
`distributed.shard` turns them into DTensor shards, and `materialize` allocates each rank's
shard and fills it. Initialisation draws every parameter from a generator seeded by
(seed, parameter name), so a shard holds exactly the values a single-process run with the same seed
would hold at that position, whatever the world size.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from model_utils.config.families import FAMILIES
from model_utils.config.fp8_plan import plan_of
from model_utils.config.run_config import Config
from model_utils.config.sections import HF_KEYS, SHAPE_FIELDS, ModelShape
from model_utils.model import loss, te_support
from model_utils.parallel.distributed import canonical_param_name, local_shard
from model_utils.precision import master_weights

if TYPE_CHECKING:  # transformers' modelling takes seconds to import: only a build needs it
    from transformers import PretrainedConfig

# Initialiser std of Llama and of transformers' LlamaConfig default.
INIT_STD = 0.02

# Buffers some HF checkpoints carry that the model recomputes from its config: never loaded.
HF_RECOMPUTED = ("rotary_emb.inv_freq",)

#: The shape fields a family's config takes as they are (config/sections.HF_KEYS names them); RoPE
#: and the position count are composed below.
_AS_IS = (*SHAPE_FIELDS, "rms_norm_eps", "tie_word_embeddings")


def model_config(shape: ModelShape) -> PretrainedConfig:
    """The HF config of `shape` in its family's class with the values its row builds (RoPE as
    one dict, as transformers 5 takes it; head_dim stated: Mistral's default is a constant)."""
    family = FAMILIES[shape.model_family]
    rope = {**(shape.rope_scaling or {"rope_type": "default"}), "rope_theta": shape.rope_theta}
    positions = max(shape.max_position_embeddings or 0, shape.max_context_width)
    return family.hf_class("config_class")(
        **{HF_KEYS[name]: getattr(shape, name) for name in _AS_IS},
        **family.built,
        head_dim=shape.head_dim,
        max_position_embeddings=positions,
        rope_parameters=rope,
        initializer_range=INIT_STD,
        use_cache=False,
    )


def attention_backend(device: torch.device) -> str:
    """flash-attention 2 where it is installed on a GPU, PyTorch SDPA everywhere else."""
    if device.type == "cuda":
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"


def build(
    args: Config,
    impl: str,
    device: torch.device,
    fp8_recipe: object = None,
    build_te: Callable[..., nn.Module] | None = None,
) -> nn.Module:
    """The model for `impl` (hf, te, te_linear) with every parameter on the meta device.

    `fp8_recipe` is the TE recipe --fp8_weights quantizes the weights for (TE only). `build_te`
    is the TE model's builder (te_llama.build_te_llama), passed in because the model file lives
    above this package and only the TE path needs it."""
    config, plan = model_config(args.model), plan_of(args)
    with torch.device("meta"):
        if impl in ("te", "te_linear"):
            if build_te is None:
                raise ValueError(f"--model_impl {impl} needs build_te (te_llama.build_te_llama)")
            model = build_te(
                config,
                impl=impl,
                fp8_weights=plan.weights,
                fp8_recipe=fp8_recipe,
                bf16_layers=plan.kept_layers,
            )
        else:
            causal_lm = FAMILIES[args.model.model_family].hf_class("causal_lm_class")
            model = causal_lm._from_config(
                config, attn_implementation=attention_backend(device), dtype=torch.float32
            )
    if args.optim.master_weights == "optimizer":  # fp32 copies live in the optimizer instead
        master_weights.store_parameters_in(model, torch.bfloat16)
    return (
        loss.use_chunked_loss(model, compiled=args.parallel.compile, fp8=plan.lm_head)
        if args.parallel.chunked_loss
        else loss.annotate_lm_head(model)
    )


def initial_value(
    name: str, shape: torch.Size, seed: int, device: torch.device, std: float = INIT_STD
) -> torch.Tensor:
    """The full initial tensor of one parameter: norms start at one, biases at zero, matrices
    (linears, fused TE QKV/FC1, embeddings) at N(0, std) as in transformers' Llama."""
    if len(shape) == 1:
        return (torch.zeros if name.endswith("bias") else torch.ones)(shape, device=device)
    gen = torch.Generator(device=device)
    # crc32 is stable across processes and Python versions (hash() is salted per process).
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return torch.empty(shape, device=device).normal_(0.0, std, generator=gen)


@torch.no_grad()
def init_weights(
    model: nn.Module, seed: int, std: float = INIT_STD, keep_master_seeds: bool = False
) -> None:
    """Fill every parameter (sharded or not) with the values a single-process init would give.

    Values depend on (seed, HF parameter name) only, in every --model_impl. One full parameter
    at a time is generated and this rank's shard is copied out of it, so peak
    extra memory is the largest single parameter, never the model. An FP8 parameter
    (--fp8_weights) quantises the fp32 values as it takes them. ``keep_master_seeds``
    (--master_weights optimizer) keeps the fp32 shard of every parameter stored in bf16 or FP8,
    so the optimizer's masters start from the init itself (master_weights.seed_masters).
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    # Where each parameter's initial values come from: itself, or for a layout that fuses HF
    # parameters (te) the HF parameters it is concatenated from (the model's state_dict_adapter),
    # so that one seed gives the same starting model in hf, te_linear and te.
    adapter = getattr(model, "state_dict_adapter", None)
    for wrapped_name, param in model.named_parameters():
        name = canonical_param_name(wrapped_name)  # init must not depend on AC/compile wrapping
        local = local_shard(param)
        parts = adapter.hf_parts(name, tuple(param.shape)) if adapter else [(name, param.shape)]
        full = torch.cat([initial_value(*part, seed, local.device, std) for part in parts])
        if isinstance(param, DTensor):
            # src_data_rank=None: every rank already holds the same full tensor; no communication.
            full = distribute_tensor(
                full, param.device_mesh, param.placements, src_data_rank=None
            ).to_local()
        local.copy_(full if master_weights.is_quantized(local) else full.to(local.dtype))
        if keep_master_seeds:
            master_weights.remember_full_precision(param, full)


@torch.no_grad()
def reset_buffers(model: nn.Module, config: PretrainedConfig) -> None:
    """Recompute non-persistent buffers (RoPE inverse frequencies) that `to_empty` left unset."""
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding") and hasattr(module, "inv_freq"):
            fresh = type(module)(config)
            for buf_name, buf in fresh.named_buffers(recurse=False):
                getattr(module, buf_name).copy_(buf)
            if hasattr(fresh, "attention_scaling"):
                module.attention_scaling = fresh.attention_scaling


def materialize(
    model: nn.Module, device: torch.device, seed: int, keep_master_seeds: bool = False
) -> None:
    """Allocate this rank's shards on `device` and initialise them deterministically
    (``keep_master_seeds``: see init_weights)."""
    model.to_empty(device=device)
    if getattr(model, "te_impl", None):
        te_support.reset_te_parameters(model)  # TE builds its real (maybe FP8) parameters here
    init_weights(model, seed, keep_master_seeds=keep_master_seeds)
    reset_buffers(model, model.config)


def count_parameters(model: nn.Module) -> int:
    """Global parameter count (DTensor shapes are global)."""
    return sum(p.numel() for p in model.parameters())
