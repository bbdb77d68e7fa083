"""Model families: one row per decoder architecture this recipe trains (Llama, Mistral), read
by the build, the --init_from_hf check (config.json's model_type picks the row), the HF export,
the FLOPs, the sharding and te_llama.py (its HF <-> TE weight table). In the config stage, the
first that needs it; transformers' classes are named, not imported, so parsing stays light."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

#: Attribute of te_llama's decoder layer holding the TE ``TransformerLayer``: a parameter name
#: containing it belongs to the fused ``te`` layout (QKV in one weight, gate/up in ``fc1``).
TE_LAYER_ATTR = "transformer_layer"


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


#: Every parameter of one Llama-shaped decoder layer, HF name(s) -> TE name (relative to the
#: layer). QKV is one fused parameter (``fuse_qkv_params=True``): TE cannot split FP8 primary
#: weights into several parameters, and one layout for FP8 and high-precision weights keeps
#: every checkpoint loadable with ``--fp8_weights`` on or off.
LLAMA_LAYER_MAP: tuple[ParamMapping, ...] = (
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


@dataclass(frozen=True)
class ModelFamily:
    """One architecture. Every row shares the shape (sections.HF_KEYS); ``built``: the config
    values the build writes and a config.json must have (else another model: refused);
    ``flops``: report/metrics/flops.FORMULAS' key; ``decoder_path``: the FSDP/recompute units."""

    name: str  # config.json's model_type
    config_class: str
    causal_lm_class: str
    layer_map: tuple[ParamMapping, ...]
    built: Mapping[str, Any]
    decoder_path: str = "model.layers"
    flops: str = "dense"

    def hf_class(self, which: str) -> type:
        import transformers  # seconds to import: only a build needs it

        return getattr(transformers, getattr(self, which))


LLAMA = ModelFamily(
    "llama",
    "LlamaConfig",
    "LlamaForCausalLM",
    LLAMA_LAYER_MAP,
    {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False},
)
#: Mistral's decoder is Llama's (same weight names) plus a sliding window, built without one:
#: ModelShape states no window, so a windowed checkpoint would train another model.
MISTRAL = ModelFamily(
    "mistral",
    "MistralConfig",
    "MistralForCausalLM",
    LLAMA_LAYER_MAP,
    {"hidden_act": "silu", "sliding_window": None},
)
FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (LLAMA, MISTRAL)}


def family_of(config: Any) -> ModelFamily:
    """The row of a transformers config (its ``model_type``); ValueError naming the known."""
    if config.model_type not in FAMILIES:
        raise ValueError(f"{config.model_type!r} is no model family here ({', '.join(FAMILIES)})")
    return FAMILIES[config.model_type]
