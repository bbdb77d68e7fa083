"""Llama on Transformer Engine (TE): decoder layers, the HF<->TE weight mapping, init.

Two TE implementations of the same Hugging Face Llama:

* ``te``: every ``LlamaDecoderLayer`` is replaced by :class:`TELlamaDecoderLayer`, a thin adapter
  around ``te.pytorch.TransformerLayer`` (RMSNorm, SwiGLU, GQA, no bias, causal, ``bshd``) that
  honours the decoder-layer call contract of transformers 5.x: it accepts the keyword arguments
  ``LlamaModel.forward`` passes and returns a tensor. The embeddings, final norm, ``lm_head`` and
  the causal-mask logic stay Hugging Face's, so generation helpers, losses and exports keep working.
* ``te_linear``: the stock HF model whose decoder linears are swapped for ``te.pytorch.Linear``
  (same parameter names as HF; ``lm_head`` and any linear with a dimension not divisible by 16
  stay ``nn.Linear``).

Nothing here monkey-patches transformers' classes, and TE is imported lazily: importing this
module never needs TE; building a TE model without TE raises :class:`TEUnavailableError`.

Weights are always described by :data:`LAYER_PARAM_MAP` (HF name(s) -> TE name), the single
source of truth used by :func:`hf_to_te_state_dict` / :func:`te_to_hf_state_dict`, by
``--init_from_hf`` / ``--export_hf`` and by checkpoint conversion.
"""

from __future__ import annotations

import copy
import functools
import importlib
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import torch
from torch import nn

from model_utils.precision import FP8_DIM_MULTIPLE  # FP8 GEMMs need multiples of 16

ModelImpl = Literal["te", "te_linear"]

#: Prefix of the decoder layers inside ``LlamaForCausalLM.state_dict()``.
LAYER_PREFIX = "model.layers."
#: Attribute of :class:`TELlamaDecoderLayer` holding the TE ``TransformerLayer``.
TE_LAYER_ATTR = "transformer_layer"
#: Wrapper segments that do not belong to a parameter's identity (activation checkpointing,
#: torch.compile, FSDP1): stripped before a name is mapped or seeded.
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


class TEUnavailableError(ImportError):
    """Transformer Engine is not importable here (it needs an NVIDIA GPU build, e.g. NGC)."""


def import_te() -> ModuleType:
    """Return ``transformer_engine.pytorch`` or raise a one-line, actionable error."""
    try:
        return importlib.import_module("transformer_engine.pytorch")
    except ImportError as err:  # also catches a TE build that cannot load its CUDA library
        raise TEUnavailableError(
            "Transformer Engine is not available (import transformer_engine.pytorch failed: "
            f"{err}). Use --model_impl hf, or run inside the NGC PyTorch container built by "
            "0.transformer-engine.dockerfile."
        ) from err


def te_available() -> bool:
    """True when ``transformer_engine.pytorch`` imports (used by ``--model_impl auto``)."""
    try:
        import_te()
    except TEUnavailableError:
        return False
    return True


# --------------------------------------------------------------------------------------------
# The HF <-> TE weight mapping, as data.
# --------------------------------------------------------------------------------------------


def head_dim_of(config: Any) -> int:
    """Per-head width: ``config.head_dim`` when set, else ``hidden_size // num_attention_heads``."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


#: Row counts of the parts of a fused TE weight, by name, from the config.
ROW_COUNTS: dict[str, Callable[[Any], int]] = {
    "q": lambda c: c.num_attention_heads * head_dim_of(c),
    "kv": lambda c: c.num_key_value_heads * head_dim_of(c),
    "ffn": lambda c: c.intermediate_size,
}


@dataclass(frozen=True)
class ParamMapping:
    """One TE parameter of a decoder layer and the HF parameter(s) it is made of.

    Several HF tensors are concatenated along dim 0 in the listed order, with the row counts
    named in ``rows`` (:data:`ROW_COUNTS`). TE's SwiGLU gates the *first* half of ``fc1``, so
    ``gate_proj`` comes first; the fused QKV weight (``qkv_weight_interleaved=False``) is
    ``[q; k; v]`` with heads in HF order, and TE's GQA maps query head ``h`` to KV head
    ``h // (heads / kv_heads)`` exactly like HF's ``repeat_kv``.
    """

    hf: tuple[str, ...]
    te: str
    rows: tuple[str, ...] = ()

    def split_sizes(self, config: Any) -> list[int]:
        """Row count of each HF part inside the TE tensor."""
        return [ROW_COUNTS[r](config) for r in self.rows]


def _te(name: str) -> str:
    return f"{TE_LAYER_ATTR}.{name}"


#: Every parameter of one Llama decoder layer, HF name(s) -> TE name (relative to the layer).
#: QKV is one fused parameter (``fuse_qkv_params=True``): TE cannot split FP8 primary weights
#: into several parameters, and one layout for FP8 and high-precision weights keeps every
#: checkpoint loadable with ``--fp8_weights`` on or off.
LAYER_PARAM_MAP: tuple[ParamMapping, ...] = (
    ParamMapping(
        ("input_layernorm.weight",), _te("self_attention.layernorm_qkv.layer_norm_weight")
    ),
    ParamMapping(
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        _te("self_attention.layernorm_qkv.weight"),
        rows=("q", "kv", "kv"),
    ),
    ParamMapping(("self_attn.o_proj.weight",), _te("self_attention.proj.weight")),
    ParamMapping(("post_attention_layernorm.weight",), _te("layernorm_mlp.layer_norm_weight")),
    ParamMapping(
        ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
        _te("layernorm_mlp.fc1_weight"),
        rows=("ffn", "ffn"),
    ),
    ParamMapping(("mlp.down_proj.weight",), _te("layernorm_mlp.fc2_weight")),
)

#: TE parameters that are RMSNorm gains (initialised to ones); all other TE layer weights are
#: linear weights (initialised from normal(0, initializer_range)).
TE_NORM_PARAMS: frozenset[str] = frozenset(
    m.te for m in LAYER_PARAM_MAP if m.te.endswith("norm_weight")
)

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def is_te_extra_state_key(key: str) -> bool:
    """TE modules add ``<module>._extra_state`` (FP8 scaling metadata) to their state dict.

    Weights converted from HF have none; load them with ``strict=False`` and accept exactly
    these missing keys (TE starts fresh FP8 statistics, as after a change of recipe).
    """
    return key.endswith("._extra_state") or key == "_extra_state"


def canonical_param_name(name: str) -> str:
    """Strip wrapper segments (activation checkpointing, compile, FSDP1) from a parameter name."""
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def hf_parts(name: str, shape: tuple[int, ...], config: Any) -> list[tuple[str, tuple[int, ...]]]:
    """The HF parameters a ``te``-layout parameter is made of, as ``(hf_name, shape)`` in
    concatenation order; a name outside the table maps to itself. Used to initialise the TE
    layout from the values the HF layout would get, so a seed means one model in every impl."""
    match = _LAYER_KEY.match(name)
    mapping = next((m for m in LAYER_PARAM_MAP if match and match.group(2) == m.te), None)
    if mapping is None:
        return [(name, tuple(shape))]
    prefix = f"{LAYER_PREFIX}{match.group(1)}."
    if len(mapping.hf) == 1:
        return [(prefix + mapping.hf[0], tuple(shape))]
    rows = mapping.split_sizes(config)
    return [(prefix + hf, (n, *shape[1:])) for hf, n in zip(mapping.hf, rows, strict=True)]


def hf_to_te_state_dict(
    state_dict: Mapping[str, torch.Tensor], config: Any
) -> dict[str, torch.Tensor]:
    """Convert a ``LlamaForCausalLM`` state dict (HF names) to the ``te`` implementation's names.

    Non-layer tensors (embeddings, final norm, lm_head) keep their names. Raises ``KeyError``
    naming the first missing or unexpected decoder-layer tensor, so a partial checkpoint cannot
    load silently. Tensors are not copied unless a concatenation is needed.
    """
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for layer in range(config.num_hidden_layers):
        prefix = f"{LAYER_PREFIX}{layer}."
        for mapping in LAYER_PARAM_MAP:
            names = [prefix + hf for hf in mapping.hf]
            missing = [n for n in names if n not in state_dict]
            if missing:
                raise KeyError(f"HF state dict has no {missing[0]!r} (needed for {mapping.te})")
            parts = [state_dict[n] for n in names]
            out[prefix + mapping.te] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            used.update(names)
    for key, tensor in state_dict.items():
        if key in used or key.endswith("rotary_emb.inv_freq"):  # old HF files carry RoPE buffers
            continue
        if _LAYER_KEY.match(key):
            raise KeyError(f"unexpected decoder-layer tensor {key!r} in HF state dict")
        out[key] = tensor
    return out


def te_to_hf_state_dict(
    state_dict: Mapping[str, torch.Tensor], config: Any
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`hf_to_te_state_dict`; drops TE's ``_extra_state`` entries.

    Accepts names with wrapper segments (``_checkpoint_wrapped_module.``) and converts
    low-precision or distributed tensors by the caller's choice beforehand (pass plain tensors).
    """
    clean = {
        canonical_param_name(k): v for k, v in state_dict.items() if not is_te_extra_state_key(k)
    }
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for layer in range(config.num_hidden_layers):
        prefix = f"{LAYER_PREFIX}{layer}."
        for mapping in LAYER_PARAM_MAP:
            key = prefix + mapping.te
            if key not in clean:
                raise KeyError(f"TE state dict has no {key!r}")
            tensor = clean[key]
            if len(mapping.hf) == 1:
                out[prefix + mapping.hf[0]] = tensor
            else:
                sizes = mapping.split_sizes(config)
                if sum(sizes) != tensor.shape[0]:
                    raise ValueError(f"{key}: {tensor.shape[0]} rows, config implies {sizes}")
                for hf_name, part in zip(mapping.hf, tensor.split(sizes, dim=0), strict=True):
                    out[prefix + hf_name] = part
            used.add(key)
    for key, tensor in clean.items():
        if key in used:
            continue
        if _LAYER_KEY.match(key):
            raise KeyError(f"unexpected decoder-layer tensor {key!r} in TE state dict")
        out[key] = tensor
    return out


# --------------------------------------------------------------------------------------------
# FP8 scaling state as plain tensors (what TE pickles into ``_extra_state``).
# --------------------------------------------------------------------------------------------

#: Per TE module and direction, the delayed-scaling tensors TE keeps in
#: ``fp8_meta["scaling_fwd" | "scaling_bwd"]`` (``.scale`` [n], ``.amax_history`` [len, n]; n is 3
#: per GEMM forward and 2 backward). Current, block and MXFP8 scaling keep no state.
FP8_DIRECTIONS = ("fwd", "bwd")
RECIPE_KEY = "recipe"


def _fp8_stateful_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """TE modules (anything with TE's ``fp8_meta`` and ``init_fp8_meta_tensors``), by clean name."""
    for name, module in model.named_modules():
        if isinstance(getattr(module, "fp8_meta", None), dict) and hasattr(
            module, "init_fp8_meta_tensors"
        ):
            yield canonical_param_name(name), module


def recipe_identity(recipe: Any) -> dict[str, Any]:
    """The recipe class and the fields that shape its scaling state, as JSON-able values."""
    identity: dict[str, Any] = {"class": type(recipe).__name__}
    for field in ("fp8_format", "amax_history_len", "amax_compute_algo", "margin"):
        value = getattr(recipe, field, None)
        if value is not None:
            identity[field] = getattr(value, "name", value) if not callable(value) else "custom"
    return identity


def _json_tensor(payload: dict[str, Any]) -> torch.Tensor:
    return torch.tensor(list(json.dumps(payload, sort_keys=True).encode()), dtype=torch.uint8)


def decode_recipe_identity(tensor: torch.Tensor) -> dict[str, Any]:
    return json.loads(bytes(tensor.cpu().tolist()).decode())


def fp8_scaling_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every TE module's delayed-scaling state as plain tensors: ``<module>.scale_fwd``,
    ``amax_history_fwd``, ``scale_bwd``, ``amax_history_bwd`` and ``<module>.recipe`` (the
    recipe's identity as UTF-8 JSON bytes).

    TE's own ``_extra_state`` pickles these with the recipe object, and TE >= 2.18 refuses to
    unpickle that (it could run code) unless the user sets an unsafe variable; plain tensors
    need no trust decision and load on every TE release. Amaxes are all-reduced over the
    data-parallel group, so every rank holds the same values.
    """
    out: dict[str, torch.Tensor] = {}
    for name, module in _fp8_stateful_modules(model):
        meta = module.fp8_meta
        recipe = meta.get("recipe")
        if recipe is None or not recipe.delayed() or "scaling_fwd" not in meta:
            continue
        prefix = f"{name}." if name else ""
        for direction in FP8_DIRECTIONS:
            state = meta[f"scaling_{direction}"]
            out[f"{prefix}scale_{direction}"] = state.scale
            out[f"{prefix}amax_history_{direction}"] = state.amax_history
        out[prefix + RECIPE_KEY] = _json_tensor(recipe_identity(recipe))
    return out


@torch.no_grad()
def load_fp8_scaling_state(
    model: nn.Module, tensors: Mapping[str, torch.Tensor], recipe: Any
) -> list[str]:
    """Put :func:`fp8_scaling_state` tensors back into the TE modules that run ``recipe`` (a
    delayed-scaling recipe); returns the names of the modules restored.

    Does what TE's ``set_extra_state`` does after unpickling: set the recipe and GEMM count,
    let TE allocate its recipe state, then copy scales and histories in place (TE's amax
    reduction buffers view these very tensors). A history saved with another
    ``--amax_history_len`` is cut or zero-padded, as TE resizes it.
    """
    restored = []
    for name, module in _fp8_stateful_modules(model):
        prefix = f"{name}." if name else ""
        if f"{prefix}scale_fwd" not in tensors:
            continue
        meta = module.fp8_meta
        meta["recipe"] = recipe
        meta["num_gemms"] = tensors[f"{prefix}scale_fwd"].numel() // 3
        meta["fp8_checkpoint"] = True
        module.init_fp8_meta_tensors(recipe)
        for direction in FP8_DIRECTIONS:
            state = meta[f"scaling_{direction}"]
            state.scale.copy_(tensors[f"{prefix}scale_{direction}"])
            saved = tensors[f"{prefix}amax_history_{direction}"]
            rows = min(saved.shape[0], state.amax_history.shape[0])
            state.amax_history.zero_()
            state.amax_history[:rows].copy_(saved[:rows])
        restored.append(name)
    return restored


# --------------------------------------------------------------------------------------------
# RoPE: frequencies from the config, in TE's layout.
# --------------------------------------------------------------------------------------------


def rope_parameters(config: Any) -> dict[str, Any]:
    """The RoPE settings of a Llama config as a plain dict with ``rope_type`` and ``rope_theta``.

    transformers 5.x keeps them in ``config.rope_parameters``; older configs used ``rope_theta``
    and ``rope_scaling`` attributes. Both are read so a config from either era works.
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None) or {}
    for key, value in dict(legacy).items():
        params.setdefault(key, value)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params["type"]
    params.setdefault("rope_type", "default")
    return params


def llama_rope_inv_freq(config: Any) -> torch.Tensor:
    """Inverse RoPE frequencies (fp32, ``[head_dim // 2]``) for ``default`` and ``llama3`` RoPE.

    Written from the Llama 3 reference (wavelength bands with linear smoothing) rather than
    borrowed from transformers, so tests can check it against HF independently. Other RoPE
    types are refused: TE receives these frequencies verbatim and a silent mismatch with the
    HF checkpoint's positional encoding would only show as worse loss.
    """
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    head_dim = head_dim_of(config)
    # Explicitly on CPU: models are built under ``torch.device("meta")``, and meta frequencies
    # would have no values to copy later.
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (float(params["rope_theta"]) ** exponent)
    if rope_type == "default":
        return inv_freq
    if rope_type != "llama3":
        raise ValueError(
            f"rope_type {rope_type!r} is not supported by the TE implementation "
            "(supported: default, llama3); use --model_impl hf"
        )
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    context = float(params["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(medium, blended, scaled)


def rope_angles(inv_freq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """TE's ``rotary_pos_emb``: angles ``[seq, 1, 1, head_dim]`` in fp32, halves duplicated.

    TE (non-interleaved) rotates halves exactly like HF's ``rotate_half`` and takes cos/sin of
    these angles itself, so ``cat(freqs, freqs)`` here equals HF's ``emb`` before ``cos``.
    """
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :]


def _positions(
    position_ids: torch.Tensor | None, seq_len: int, device: torch.device
) -> torch.Tensor:
    """One position vector for the batch: TE's fused RoPE takes ``[s, 1, 1, d]`` frequencies."""
    if position_ids is None:
        return torch.arange(seq_len, device=device)
    if position_ids.dim() == 1:
        return position_ids
    if position_ids.shape[0] > 1 and not bool((position_ids == position_ids[:1]).all()):
        raise ValueError(
            "TE decoder layers need the same position_ids for every sequence in the batch "
            "(packed training windows satisfy this); use --model_impl hf for per-row positions"
        )
    return position_ids[0]


def hf_mask_to_te(attention_mask: torch.Tensor | None) -> tuple[str, torch.Tensor | None]:
    """Map HF's 4-D mask to TE's ``(self_attn_mask_type, attention_mask)``.

    HF passes ``None`` for plain causal attention (SDPA, no padding): TE's built-in ``causal``
    is used. Otherwise the mask already combines causality and padding; TE takes it as an
    ``arbitrary`` boolean mask where True means *masked out* (HF's bool masks mean *attend*,
    its float masks are additive with large negatives at masked positions).
    """
    if attention_mask is None:
        return "causal", None
    if attention_mask.dim() != 4:
        raise ValueError(
            "TE decoder layers expect HF's 4-D attention mask, got shape "
            f"{tuple(attention_mask.shape)} (is config._attn_implementation flash-attention?)"
        )
    if attention_mask.dtype == torch.bool:
        return "arbitrary", ~attention_mask
    return "arbitrary", attention_mask < 0


# --------------------------------------------------------------------------------------------
# The decoder layer.
# --------------------------------------------------------------------------------------------


def _normal_init(std: float) -> Callable[[torch.Tensor], torch.Tensor]:
    return functools.partial(nn.init.normal_, mean=0.0, std=std)


def _check_llama_config(config: Any) -> None:
    """Refuse Llama variants the TE layer would compute differently, with the reason."""
    problems = []
    if getattr(config, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={config.hidden_act!r} (TE layer uses SwiGLU = silu gate)")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        problems.append("attention_bias/mlp_bias (TE layer is built without biases)")
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        problems.append(f"pretraining_tp={config.pretraining_tp}")
    if problems:
        raise ValueError("config not supported by the TE Llama layer: " + "; ".join(problems))
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
    """A Llama decoder layer computed by ``te.pytorch.TransformerLayer``.

    Call contract (transformers 5.23 ``LlamaModel.forward``): ``layer(hidden_states,
    attention_mask=..., position_embeddings=(cos, sin), position_ids=..., past_key_values=...,
    use_cache=..., **kwargs) -> Tensor``. HF's ``(cos, sin)`` are not reused: TE wants fp32
    angles, which are recomputed from the config's RoPE settings and ``position_ids`` (cheap:
    ``seq x head_dim`` per layer) so they keep full precision under bf16 compute.
    """

    def __init__(self, config: Any, layer_idx: int, *, device: str | torch.device | None = None):
        super().__init__()
        _check_llama_config(config)
        te = import_te()
        self.layer_idx = layer_idx
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
            device=_te_device() if device is None else device,
        )
        # A plain attribute, not a buffer: buffers on the meta device come back as garbage
        # after ``to_empty`` and nobody would re-initialise them.
        self._inv_freq_cpu = llama_rope_inv_freq(config)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}
        #: Set per micro-batch by :func:`set_is_first_microbatch` (TE caches FP8 weights).
        self.is_first_microbatch: bool | None = None

    def reset_rope_buffers(self) -> None:
        """Nothing to reset: frequencies live in a plain CPU attribute, not a meta buffer."""

    def _rotary_pos_emb(self, hidden_states: torch.Tensor, position_ids: torch.Tensor | None):
        device = hidden_states.device
        if device not in self._inv_freq:
            self._inv_freq[device] = self._inv_freq_cpu.to(device)
        positions = _positions(position_ids, hidden_states.shape[1], device)
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
        is_first_microbatch = kwargs.pop("is_first_microbatch", self.is_first_microbatch)
        rotary_pos_emb = self._rotary_pos_emb(hidden_states, position_ids)
        mask_type, te_mask = hf_mask_to_te(attention_mask)
        return self.transformer_layer(
            hidden_states,
            attention_mask=te_mask,
            self_attn_mask_type=mask_type,
            rotary_pos_emb=rotary_pos_emb,
            is_first_microbatch=is_first_microbatch,
        )


# --------------------------------------------------------------------------------------------
# Building the models.
# --------------------------------------------------------------------------------------------


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
    """``LlamaForCausalLM`` from a private copy of ``config`` (with ``use_cache=False``)."""
    from transformers import LlamaForCausalLM

    cfg = copy.deepcopy(config)
    cfg.use_cache = False  # TE layers keep no KV cache; HF would otherwise allocate one
    if num_layers is None:
        return LlamaForCausalLM(cfg)
    total = cfg.num_hidden_layers
    cfg.num_hidden_layers = num_layers
    model = LlamaForCausalLM(cfg)
    model.config.num_hidden_layers = total
    return model


def build_te_llama(
    config: Any,
    *,
    impl: ModelImpl,
    fp8_weights: bool = False,
    fp8_recipe: Any = None,
) -> nn.Module:
    """Build ``LlamaForCausalLM`` whose decoder runs on TE (``impl="te"`` or ``"te_linear"``).

    Follows the ambient ``torch.device`` context: build under ``torch.device("meta")``, shard,
    then ``model_utils.modeling.materialize``. ``fp8_weights=True`` constructs the TE
    modules under ``quantized_model_init(recipe=fp8_recipe)``: weights are held only in FP8
    (FSDP2 all-gathers FP8 bytes; inference memory halves); training with them needs an
    optimizer with fp32 master weights (TE's FusedAdam(master_weights=True)).
    """
    if impl not in ("te", "te_linear"):
        raise ValueError(f"impl must be 'te' or 'te_linear', got {impl!r}")
    _check_llama_config(config)
    import_te()
    with quantized_init_context(fp8_weights, fp8_recipe):
        if impl == "te":
            model = _skeleton(config, num_layers=0)
            model.model.layers = nn.ModuleList(
                TELlamaDecoderLayer(model.config, i) for i in range(model.config.num_hidden_layers)
            )
        else:
            model = _skeleton(config)
            model.te_linear_skipped = swap_linears_for_te(model)
    model.te_impl = impl
    return model


def _first_microbatch_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    kwargs.setdefault("is_first_microbatch", getattr(module, "te_is_first_microbatch", None))
    return args, kwargs


def swap_linears_for_te(model: nn.Module) -> list[str]:
    """Replace the decoder layers' ``nn.Linear`` by ``te.pytorch.Linear``; return skipped names.

    Parameter names are unchanged (``...q_proj.weight``), so HF checkpoints load directly.
    ``lm_head`` is never swapped (FP8 logits hurt loss; the vocab GEMM stays high precision);
    linears with a dimension not divisible by 16 cannot run FP8 GEMMs and are skipped.
    ``is_first_microbatch`` reaches the TE linears through a forward pre-hook because HF's
    attention/MLP call them with the input only.
    """
    te = import_te()
    device = _te_device()
    std = float(model.config.initializer_range)
    skipped: list[str] = []
    for layer_idx, layer in enumerate(model.model.layers):
        for owner_name, owner in list(layer.named_modules()):
            for child_name, child in list(owner.named_children()):
                if type(child) is not nn.Linear:
                    continue
                full = f"{LAYER_PREFIX}{layer_idx}.{owner_name}.{child_name}".replace("..", ".")
                if child.in_features % FP8_DIM_MULTIPLE or child.out_features % FP8_DIM_MULTIPLE:
                    skipped.append(full)
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
                te_linear.te_is_first_microbatch = None
                setattr(owner, child_name, te_linear)
    return skipped


def te_modules(model: nn.Module) -> Iterator[nn.Module]:
    """TE modules that take ``is_first_microbatch``: our decoder layers and swapped linears."""
    for module in model.modules():
        if isinstance(module, TELlamaDecoderLayer) or hasattr(module, "te_is_first_microbatch"):
            yield module


def set_is_first_microbatch(model: nn.Module, value: bool | None) -> None:
    """Tell TE whether the next forward starts a new optimizer step (True), continues gradient
    accumulation (False), or is outside training (None: no FP8 weight caching)."""
    for module in te_modules(model):
        if isinstance(module, TELlamaDecoderLayer):
            module.is_first_microbatch = value
        else:
            module.te_is_first_microbatch = value


# --------------------------------------------------------------------------------------------
# Initialisation: meta device -> to_empty -> reset_te_parameters -> modeling.init_weights.
# --------------------------------------------------------------------------------------------


def reset_te_parameters(model: nn.Module) -> None:
    """Let TE modules build their real parameters; call after ``to_empty``, before init.

    Every TE module exposes ``reset_parameters(defer_init=False)``, which materialises meta
    parameters, runs TE's init and, under ``quantized_model_init`` (``--fp8_weights``), turns
    them into FP8 tensors (``to_empty`` alone leaves plain high-precision tensors). A
    deterministic init afterwards writes through ``copy_``, which TE quantizes.
    """
    for module in model.modules():
        if hasattr(module, "param_init_meta") and hasattr(module, "reset_parameters"):
            module.reset_parameters(defer_init=False)
