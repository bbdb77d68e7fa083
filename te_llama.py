"""Llama-shaped decoders (the families of config/families.py) on Transformer Engine (TE).

Two TE implementations of the same Hugging Face model:

* ``te``: every HF decoder layer (``LlamaDecoderLayer``, ``MistralDecoderLayer``) is replaced by
  :class:`TELlamaDecoderLayer`, a thin adapter around ``te.pytorch.TransformerLayer`` (RMSNorm,
  SwiGLU, GQA, no bias, causal, ``bshd``) that honours the decoder-layer call contract of
  transformers 5.x: it accepts the keyword arguments ``LlamaModel.forward`` (and
  ``MistralModel.forward``) passes and returns a tensor. The embeddings, final norm, ``lm_head`` and
  the causal-mask logic stay Hugging Face's, so generation helpers, losses and exports keep working.
* ``te_linear``: the stock HF model whose decoder linears are swapped for ``te.pytorch.Linear``
  (same parameter names as HF; ``lm_head`` and any linear with a dimension not divisible by 16
  stay ``nn.Linear``).

Nothing here monkey-patches transformers, and importing this module never needs TE (building a
TE model without it raises ``TEUnavailableError``). The TE glue of model_utils: TE's import in
config/te_loader.py, FP8 state in precision/te_state.py, RoPE and masks in model/te_support.py.

Weights are always described by the family's ``layer_map`` (HF name(s) -> TE name), the single
source of truth behind :class:`StateDictAdapter`, which converts for ``--init_from_hf`` /
``--export_hf``, for checkpoints of the other layout and for scripts/convert_checkpoint.py.
"""

from __future__ import annotations

import copy
import functools
import logging
import re
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal

import torch
from torch import nn

from model_utils.config.families import TE_LAYER_ATTR, family_of  # noqa: F401 (re-exported)
from model_utils.config.te_loader import import_te
from model_utils.model.modeling import HF_RECOMPUTED
from model_utils.model.te_support import (
    batch_positions,
    head_dim_of,
    hf_mask_to_te,
    is_te_extra_state_key,
    llama_rope_inv_freq,
    rope_angles,
)
from model_utils.parallel.distributed import canonical_param_name, decoder_layers
from model_utils.precision.backends import FP8_DIM_MULTIPLE  # FP8 GEMMs need multiples of 16
from model_utils.precision.te import TEBackend, te_autocast
from model_utils.precision.te_state import FIRST_MICROBATCH_ATTR

ModelImpl = Literal["te", "te_linear"]

#: Prefix of the decoder layers inside a family's ``*ForCausalLM.state_dict()``.
LAYER_PREFIX = "model.layers."

# ---- The HF <-> TE weight mapping: the family's row holds it as data (config/families.py).

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _fuse_layer(
    state_dict: Mapping[str, torch.Tensor], prefix: str, config: Any
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """One decoder layer, HF -> ``te``: the TE tensors and the HF names they consumed."""
    out: dict[str, torch.Tensor] = {}
    used: list[str] = []
    for mapping in family_of(config).layer_map:
        names = [prefix + hf for hf in mapping.hf]
        missing = [n for n in names if n not in state_dict]
        if missing:
            raise KeyError(f"HF state dict has no {missing[0]!r} (needed for {mapping.te})")
        parts = [state_dict[n] for n in names]
        out[prefix + mapping.te] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        used += names
    return out, used


def _split_layer(
    state_dict: Mapping[str, torch.Tensor], prefix: str, config: Any
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """One decoder layer, ``te`` -> HF: the HF tensors (views) and the TE names they consumed."""
    out: dict[str, torch.Tensor] = {}
    used: list[str] = []
    for mapping in family_of(config).layer_map:
        key = prefix + mapping.te
        if key not in state_dict:
            raise KeyError(f"TE state dict has no {key!r}")
        tensor = state_dict[key]
        if len(mapping.hf) == 1:
            out[prefix + mapping.hf[0]] = tensor
        else:
            sizes = mapping.split_sizes(config)
            if sum(sizes) != tensor.shape[0]:
                raise ValueError(f"{key}: {tensor.shape[0]} rows, config implies {sizes}")
            for hf_name, part in zip(mapping.hf, tensor.split(sizes, dim=0), strict=True):
                out[prefix + hf_name] = part
        used.append(key)
    return out, used


LayerMapper = Callable[
    [Mapping[str, torch.Tensor], str, Any], tuple[dict[str, torch.Tensor], list[str]]
]


def _map_layers(
    state_dict: Mapping[str, torch.Tensor],
    map_layer: LayerMapper,
    config: Any,
    source: str,
    skipped: tuple[str, ...] = (),
) -> dict[str, torch.Tensor]:
    """Map the decoder layers present in `state_dict` with `map_layer`; other tensors keep their
    names, except those ending in one of `skipped`. A decoder-layer tensor left over is an error
    (KeyError), so a partial or foreign state dict cannot load silently."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    layers = {int(m.group(1)) for m in map(_LAYER_KEY.match, state_dict) if m}
    for layer in sorted(layers):
        mapped, names = map_layer(state_dict, f"{LAYER_PREFIX}{layer}.", config)
        out.update(mapped)
        used.update(names)
    for key, tensor in state_dict.items():
        if key in used or key.endswith(skipped):
            continue
        if _LAYER_KEY.match(key):
            raise KeyError(f"unexpected decoder-layer tensor {key!r} in {source} state dict")
        out[key] = tensor
    return out


class StateDictAdapter:
    """The one HF <-> ``te`` converter for a config, used by --init_from_hf, --export_hf,
    checkpoints of the other layout and scripts/convert_checkpoint.py. Layouts are named as
    ``checkpoint.layout.param_layout`` names them: ``hf`` (--model_impl hf, te_linear), ``te``.

    ``from_hf`` / ``to_hf`` take any part of a state dict: callers pass one decoder layer (or
    the non-layer tensors) at a time so no rank ever holds the whole model. A ``te`` model built
    by :func:`build_te_llama` carries its adapter as ``model.state_dict_adapter``.
    """

    def __init__(self, config: Any) -> None:
        self.config = config

    def from_hf(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF names -> ``te`` for the decoder layers present in ``state_dict`` (KeyError naming
        a missing or unexpected layer tensor); tensors are copied only to concatenate."""
        return _map_layers(state_dict, _fuse_layer, self.config, "HF", HF_RECOMPUTED)

    def to_hf(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``te`` names (wrapper segments allowed; plain tensors) -> HF for the decoder layers
        present; TE's ``_extra_state`` is dropped (it is no weight)."""
        clean = {
            canonical_param_name(k): v
            for k, v in state_dict.items()
            if not is_te_extra_state_key(k)
        }
        return _map_layers(clean, _split_layer, self.config, "TE")

    def converter(
        self, source: str, target: str
    ) -> Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]:
        """The mapping from layout ``source`` to layout ``target`` (two different layouts)."""
        maps = {("hf", "te"): self.from_hf, ("te", "hf"): self.to_hf}
        if (source, target) not in maps:
            raise ValueError(f"no parameter mapping from layout {source!r} to {target!r}")
        return maps[(source, target)]

    def hf_parts(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        """The HF parameters a ``te``-layout parameter is made of, as ``(hf_name, shape)`` in
        concatenation order; a name outside the table maps to itself. Init draws the TE layout
        from the values the HF layout would get, so a seed means one model in every impl."""
        match = _LAYER_KEY.match(name)
        layer_map = family_of(self.config).layer_map
        mapping = next((m for m in layer_map if match and match.group(2) == m.te), None)
        if mapping is None:
            return [(name, tuple(shape))]
        prefix = f"{LAYER_PREFIX}{match.group(1)}."
        if len(mapping.hf) == 1:
            return [(prefix + mapping.hf[0], tuple(shape))]
        rows = mapping.split_sizes(self.config)
        return [(prefix + hf, (n, *shape[1:])) for hf, n in zip(mapping.hf, rows, strict=True)]


# ---- The decoder layer.


def _normal_init(std: float) -> Callable[[torch.Tensor], torch.Tensor]:
    return functools.partial(nn.init.normal_, mean=0.0, std=std)


def _check_te_config(config: Any) -> None:
    """Refuse what the TE layer (SwiGLU, no biases, causal, one TP rank) would compute
    differently: a value other than the family row's ``built`` ones, with the reason."""
    built = {**family_of(config).built, "pretraining_tp": 1}
    problems = [
        f"{k}={getattr(config, k)!r}" for k, v in built.items() if (getattr(config, k, v) or v) != v
    ]
    if problems:
        raise ValueError("config not supported by the TE decoder layer: " + "; ".join(problems))
    llama_rope_inv_freq(config)  # raises for unsupported RoPE types


def _te_device() -> str | torch.device:
    """Device for TE parameters: follow ``with torch.device(...)`` (meta for deferred init).

    TE compares ``device == "meta"`` to defer initialisation, so meta is passed as a string.
    """
    default = torch.get_default_device()
    if default.type == "meta":
        return "meta"
    if default.type == "cpu" and torch.cuda.is_available():
        return "cuda"
    return default


class TELlamaDecoderLayer(nn.Module):
    """A Llama-shaped decoder layer computed by ``te.pytorch.TransformerLayer``.

    Call contract (transformers 5.23 ``LlamaModel.forward``): ``layer(hidden_states,
    attention_mask=..., position_embeddings=(cos, sin), position_ids=..., past_key_values=...,
    use_cache=..., **kwargs) -> Tensor``. HF's ``(cos, sin)`` are not reused: TE wants fp32
    angles, which are recomputed from the config's RoPE settings and ``position_ids`` (cheap:
    ``seq x head_dim`` per layer) so they keep full precision under bf16 compute.
    """

    def __init__(self, config: Any, layer_idx: int, *, fp8: bool = True, recipe: Any = None):
        super().__init__()
        _check_te_config(config)
        te = import_te()
        self.layer_idx = layer_idx
        #: False: this layer computes in high precision inside the model's FP8 autocast
        #: (--bf16_layers), its own forward and the backward TE records for it.
        self.fp8, self.fp8_recipe = fp8, recipe
        self.hidden_size = config.hidden_size
        head_dim = head_dim_of(config)
        std = float(config.initializer_range)
        self.transformer_layer = te.TransformerLayer(
            hidden_size=config.hidden_size,
            ffn_hidden_size=config.intermediate_size,
            num_attention_heads=config.num_attention_heads,
            num_gqa_groups=config.num_key_value_heads,
            kv_channels=head_dim,
            layernorm_epsilon=config.rms_norm_eps,
            hidden_dropout=0.0,
            attention_dropout=float(config.attention_dropout or 0.0),
            init_method=_normal_init(std),
            output_layer_init_method=_normal_init(std),
            layer_number=layer_idx + 1,
            self_attn_mask_type="causal",
            fuse_qkv_params=True,
            qkv_weight_interleaved=False,
            bias=False,
            activation="swiglu",
            normalization="RMSNorm",
            attn_input_format="bshd",
            params_dtype=torch.get_default_dtype(),
            device=_te_device(),
        )
        # A plain attribute, not a buffer: buffers on the meta device come back as garbage
        # after ``to_empty`` and nobody would re-initialise them.
        self._inv_freq_cpu = llama_rope_inv_freq(config)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}
        #: Set per micro-batch by ``te_state.set_is_first_microbatch`` (TE caches FP8 weights).
        self.te_is_first_microbatch: bool | None = None
        #: ``transformer_layer`` replays CUDA graphs in training (capture_cuda_graphs).
        self.graphed = False

    def _rotary_pos_emb(self, hidden_states: torch.Tensor, position_ids: torch.Tensor | None):
        device = hidden_states.device
        if device not in self._inv_freq:
            self._inv_freq[device] = self._inv_freq_cpu.to(device)
        positions = batch_positions(position_ids, hidden_states.shape[1], device)
        return rope_angles(self._inv_freq[device], positions)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Any = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Run the TE layer on ``[batch, seq, hidden]``; returns a tensor like HF's layer."""
        if past_key_values is not None or use_cache:
            raise NotImplementedError(
                "TE decoder layers keep no KV cache: call the model with use_cache=False "
                "(export to HF with --export_hf for generation)"
            )
        is_first_microbatch = kwargs.pop("is_first_microbatch", self.te_is_first_microbatch)
        rotary_pos_emb = self._rotary_pos_emb(hidden_states, position_ids)
        mask_type, te_mask = hf_mask_to_te(attention_mask)
        if self.graphed and te_mask is not None and self.training:
            raise ValueError(
                "this layer's CUDA graph (--cuda_graphs) was captured causal, without a mask: a "
                "padding mask cannot reach it; train on packed sequences or drop --cuda_graphs"
            )
        with nullcontext() if self.fp8 else fp8_disabled(self.fp8_recipe):
            return self.transformer_layer(
                hidden_states,
                attention_mask=te_mask,
                self_attn_mask_type=mask_type,
                rotary_pos_emb=rotary_pos_emb,
                is_first_microbatch=is_first_microbatch,
            )


def capture_cuda_graphs(
    model: nn.Module, backend: TEBackend, micro_batch: int, seq_len: int
) -> None:
    """--cuda_graphs: each decoder layer's ``te.TransformerLayer`` captured, forward and backward,
    by TE's ``make_graphed_callables`` (all layers in one call: one memory pool), so a training
    step launches one graph per layer where it launched every kernel from the host.

    Captured in training mode at the training shape ``[micro_batch, seq_len, hidden]`` in the
    compute dtype, under the same torch.autocast as the steps (without its weight cache, which
    TE refuses) and with the backend's FP8 recipe and amax group; a layer kept in BF16 is
    captured without FP8. The graph's only keyword input is the RoPE angles: TE replays with the
    keywords it was captured with and drops the others (mask type and FP8 weight caching stay as
    captured). Validation runs in eval mode, which TE sends to the eager forward. Call it after
    a resume has loaded the parameters: the graphs read them where they are, and the optimizer
    updates them in place.
    """
    te = import_te()
    layers = list(decoder_layers(model))
    device = next(model.parameters()).device
    dtype = backend.torch_autocast_dtype or torch.float32
    sample_args, sample_kwargs = [], []
    for layer in layers:
        hidden = torch.randn(
            micro_batch, seq_len, layer.hidden_size, device=device, dtype=dtype, requires_grad=True
        )
        sample_args.append((hidden,))
        sample_kwargs.append({"rotary_pos_emb": layer._rotary_pos_emb(hidden, None)})
    autocast = torch.autocast(device.type, dtype=dtype, cache_enabled=False)
    with autocast if dtype != torch.float32 else nullcontext():
        te.make_graphed_callables(
            tuple(layer.transformer_layer for layer in layers),
            tuple(sample_args),
            sample_kwargs=tuple(sample_kwargs),
            enabled=tuple(backend.fp8 and layer.fp8 for layer in layers),
            recipe=backend.te_recipe if backend.fp8 else None,
            amax_reduction_group=backend.dp_group,
        )
    for layer in layers:
        layer.graphed = True
    logging.getLogger("train").info(
        "cuda graphs: %d decoder layers captured at %d x %d tokens (TE make_graphed_callables); "
        "validation runs them eagerly",
        len(layers),
        micro_batch,
        seq_len,
    )


def fp8_disabled(recipe: Any = None) -> AbstractContextManager:
    """A region computed in high precision inside an FP8 autocast: TE's nested autocast with
    ``enabled=False`` (its exit reduces no amaxes; the outer exit still does), given the run's
    `recipe`: TE's default one it refuses to build while torch.compile traces the layer."""
    return te_autocast(import_te(), enabled=False, recipe=recipe)


# ---- Building the models.


def quantized_init_context(enabled: bool, recipe: Any = None) -> AbstractContextManager:
    """TE's "weights only in FP8" construction context, whichever name this TE release has.

    ``quantized_model_init`` (TE >= 2.9) replaced ``fp8_model_init``; both take the recipe the
    weights are quantized for, which must match the training/inference recipe.
    """
    if not enabled:
        return nullcontext()
    te = import_te()
    if hasattr(te, "quantized_model_init"):
        return te.quantized_model_init(enabled=True, recipe=recipe)
    return te.fp8_model_init(enabled=True, recipe=recipe)


def _skeleton(config: Any, num_layers: int | None = None) -> nn.Module:
    """The family's ``*ForCausalLM`` from a private copy of ``config`` (``use_cache=False``)."""
    causal_lm = family_of(config).hf_class("causal_lm_class")
    cfg = copy.deepcopy(config)
    cfg.use_cache = False  # TE layers keep no KV cache; HF would otherwise allocate one
    if num_layers is None:
        return causal_lm(cfg)
    total = cfg.num_hidden_layers
    cfg.num_hidden_layers = num_layers
    model = causal_lm(cfg)
    model.config.num_hidden_layers = total
    return model


def build_te_llama(
    config: Any,
    *,
    impl: ModelImpl,
    fp8_weights: bool = False,
    fp8_recipe: Any = None,
    bf16_layers: tuple[int, ...] = (),
) -> nn.Module:
    """The family's ``*ForCausalLM`` with its decoder on TE (``impl="te"`` or ``"te_linear"``).

    Follows the ambient ``torch.device`` context: build under ``torch.device("meta")``, shard,
    then ``model_utils.model.modeling.materialize``. ``fp8_weights=True`` constructs the TE
    modules under ``quantized_model_init(recipe=fp8_recipe)``: weights are held only in FP8
    (FSDP2 all-gathers FP8 bytes; inference memory halves); training with them needs an
    optimizer with fp32 master weights (TE's FusedAdam(master_weights=True)). The decoder
    layers in ``bf16_layers`` compute in high precision while FP8 is on: TE layers disable FP8
    around their forward, and ``te_linear`` leaves their linears HF's ``nn.Linear``.
    """
    if impl not in ("te", "te_linear"):
        raise ValueError(f"impl must be 'te' or 'te_linear', got {impl!r}")
    _check_te_config(config)
    import_te()
    with quantized_init_context(fp8_weights, fp8_recipe):
        if impl == "te":
            model = _skeleton(config, num_layers=0)
            model.model.layers = nn.ModuleList(
                TELlamaDecoderLayer(model.config, i, fp8=i not in bf16_layers, recipe=fp8_recipe)
                for i in range(model.config.num_hidden_layers)
            )
        else:
            model = _skeleton(config)
            swap_linears_for_te(model, bf16_layers)
    model.te_impl = impl
    if impl == "te":
        model.state_dict_adapter = StateDictAdapter(model.config)
    return model


def _first_microbatch_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    kwargs.setdefault("is_first_microbatch", getattr(module, FIRST_MICROBATCH_ATTR, None))
    return args, kwargs


def swap_linears_for_te(model: nn.Module, bf16_layers: tuple[int, ...] = ()) -> None:
    """Replace the decoder layers' ``nn.Linear`` by ``te.pytorch.Linear``.

    Parameter names are unchanged (``...q_proj.weight``), so HF checkpoints load directly.
    ``lm_head`` is never swapped (FP8 logits hurt loss; the vocab GEMM stays high precision);
    linears with a dimension not divisible by 16 cannot run FP8 GEMMs and are skipped, and so
    are the layers in ``bf16_layers`` (kept in high precision).
    ``is_first_microbatch`` reaches the TE linears through a forward pre-hook because HF's
    attention/MLP call them with the input only.
    """
    te = import_te()
    device = _te_device()
    std = float(model.config.initializer_range)
    for layer_idx, layer in enumerate(decoder_layers(model)):
        if layer_idx in bf16_layers:
            continue
        for owner in list(layer.modules()):
            for child_name, child in list(owner.named_children()):
                if type(child) is not nn.Linear:
                    continue
                if child.in_features % FP8_DIM_MULTIPLE or child.out_features % FP8_DIM_MULTIPLE:
                    continue
                te_linear = te.Linear(
                    child.in_features,
                    child.out_features,
                    bias=child.bias is not None,
                    init_method=_normal_init(std),
                    params_dtype=child.weight.dtype,
                    device=device,
                )
                te_linear.register_forward_pre_hook(_first_microbatch_hook, with_kwargs=True)
                setattr(te_linear, FIRST_MICROBATCH_ATTR, None)
                setattr(owner, child_name, te_linear)
