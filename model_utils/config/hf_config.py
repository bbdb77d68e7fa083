"""`--init_from_hf DIR`: the checkpoint's config.json is the truth about the model.

The architecture (every shape field, RoPE base and scaling, RMSNorm epsilon) is read from
DIR/config.json the way transformers reads it (its config class, with its defaults and both
RoPE formats; model_type picks config/families.py's row), and replaces the preset's. A preset or
flag the user gave that says otherwise is refused in one line naming both values: a Llama 3.2
checkpoint trained under a Llama 3.1 preset's RoPE scaling would load and train a different
model without a word, and its export would then write the wrong RoPE into config.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from model_utils.config.families import FAMILIES, head_dim_of
from model_utils.config.presets import PRESETS
from model_utils.config.sections import HF_KEYS, SHAPE_FIELDS
from model_utils.errors import UsageError

#: The fields a config.json must agree with where a flag or --preset states them (their keys:
#: sections.HF_KEYS); max_position_embeddings is taken as it is, never contradicted.
CHECKED = tuple(name for name in HF_KEYS if name != "max_position_embeddings")
#: Fields with a flag; the others (rope_scaling, rms_norm_eps) come from the preset alone.
_FLAGGED = (*SHAPE_FIELDS, "rope_theta", "tie_word_embeddings")
#: Files that make DIR a tokenizer too: then it is the run's default --tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
#: The RoPE types te_llama computes itself (te_support.llama_rope_inv_freq); hf takes any.
TE_ROPE_TYPES = ("default", "llama3")


class ConfigError(UsageError):
    """A config.json this recipe cannot train as written, or one that a flag contradicts."""


def read_config(path: str | Path) -> Any | None:
    """transformers' config of DIR (or of a .safetensors file's folder); None when the
    path does not exist (the weights check says so in its own words)."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    if not path.exists():
        return None
    if path.is_file() and path.suffix != ".safetensors":  # name what was typed, not its folder
        raise ConfigError(
            f"--init_from_hf: {path} is a file, not a Hugging Face model: give its folder "
            "(config.json and *.safetensors, as save_pretrained writes) or a .safetensors file"
        )
    if not (folder / "config.json").is_file():
        raise ConfigError(
            f"--init_from_hf: {folder} has no config.json: the model's architecture is read "
            "from it (save the model with save_pretrained, or copy its config.json there)"
        )
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(
            str(folder), local_files_only=True, trust_remote_code=False
        )
    except Exception as exc:  # malformed JSON, an unknown model_type, ...
        raise ConfigError(f"--init_from_hf: cannot read {folder / 'config.json'}: {exc}") from exc
    if config.model_type not in FAMILIES:
        raise ConfigError(
            f"--init_from_hf: {folder / 'config.json'} is a {config.model_type!r} model; this "
            f"recipe trains the model_types {', '.join(map(repr, FAMILIES))}"
        )
    raw = config_json(folder)  # {} only if it went since transformers read it: nothing to say
    # num_key_value_heads may be left out: by the format, absent means one per attention head
    wanted = [HF_KEYS[name] for name in SHAPE_FIELDS if name != "num_key_value_heads"]
    missing = [key for key in wanted if raw and key not in raw]
    if missing:
        raise ConfigError(
            f"--init_from_hf: {folder / 'config.json'} has no {', '.join(missing)}: the model's "
            "shape is read from it, not guessed (transformers would fill in a default of its "
            "own); add them as the checkpoint was trained, or save it with save_pretrained"
        )
    return config


def config_json(path: str | Path) -> dict[str, Any]:
    """DIR's (or a .safetensors file's folder's) config.json as plain JSON, {} if unreadable."""
    path = Path(path)
    try:
        return json.loads(((path if path.is_dir() else path.parent) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def architecture(config: Any) -> dict[str, Any]:
    """Our model fields from a config, after refusing what its family's row does not build."""
    family = FAMILIES[config.model_type]
    for key, built in family.built.items():
        if getattr(config, key, built) != built:
            raise ConfigError(
                f"--init_from_hf: config.json has {key} {getattr(config, key)!r}; this recipe's "
                f"{family.name} has {key} {built!r}"
            )
    heads, width = config.num_attention_heads, config.hidden_size
    head_dim = head_dim_of(config)
    if head_dim * heads != width:
        raise ConfigError(
            f"--init_from_hf: config.json has head_dim {head_dim} with {heads} heads of hidden "
            f"size {width}; this recipe's {family.name} has head_dim = hidden_size / heads"
        )
    rope = rope_parameters(config)
    return {
        "hidden_width": width,
        "num_layers": config.num_hidden_layers,
        "num_heads": heads,
        "num_key_value_heads": config.num_key_value_heads or heads,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
        "rope_theta": float(rope.pop("rope_theta")),
        "rope_scaling": rope if rope.get("rope_type", "default") != "default" else None,
        "rms_norm_eps": float(config.rms_norm_eps),
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "model_family": family.name,
    }


def rope_parameters(config: Any) -> dict[str, Any]:
    """The RoPE settings of a config as a plain dict with ``rope_type`` and ``rope_theta``:
    transformers 5 keeps them in ``rope_parameters``; a 4.x config's ``rope_theta`` and
    ``rope_scaling`` (with ``type`` for ``rope_type``) are read the same way."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    for key, value in dict(getattr(config, "rope_scaling", None) or {}).items():
        rope.setdefault(key, value)
    rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    if "type" in rope:
        rope.setdefault("rope_type", rope.pop("type"))
    rope.setdefault("rope_type", "default")
    return rope


def _shown(field: str, value: Any, other: Any) -> str:
    """`field value` as a message shows it; of two RoPE dicts only the keys that differ."""
    if isinstance(value, dict) and isinstance(other, dict):
        keys = sorted(k for k in {*value, *other} if value.get(k) != other.get(k))
        return ", ".join(f"{field}.{k} {value.get(k)}" for k in keys)
    return f"{field} {value:g}" if isinstance(value, float) else f"{field} {value}"


def contradiction(
    field: str, theirs: Any, args: argparse.Namespace, explicit: frozenset[str]
) -> tuple[str, str] | None:
    """(what config.json says, what the user gave) for `field`, in their words, or None."""
    key = HF_KEYS[field]
    if field in _FLAGGED and field in explicit and getattr(args, field) != theirs:
        ours = getattr(args, field)
        return _shown(key, theirs, ours), f"--{_shown(field, ours, theirs)}"
    if "preset" in explicit:
        ours = getattr(PRESETS[args.preset], field)
        if ours != theirs:
            preset = f"--preset {args.preset} ({_shown(field, ours, theirs)})"
            return _shown(key, theirs, ours), preset
    return None


def apply(args: argparse.Namespace, explicit: frozenset[str]) -> None:
    """Take the model's architecture from --init_from_hf's config.json (ConfigError where a
    given flag or preset says otherwise), and its tokenizer where it has one and none was given."""
    config = read_config(args.init_from_hf)
    if config is None:
        return
    found = architecture(config)
    for field in CHECKED:
        found_given = contradiction(field, found[field], args, explicit)
        if found_given:
            said, given = found_given
            raise ConfigError(
                f"--init_from_hf {args.init_from_hf}: its config.json has {said}, but {given} "
                "says otherwise: the model is the checkpoint's, so drop the contradicting flag "
                "(or --preset)"
            )
    for field, value in found.items():
        setattr(args, field, value)
    folder = Path(args.init_from_hf)
    folder = folder if folder.is_dir() else folder.parent
    if "tokenizer" not in explicit and any((folder / f).is_file() for f in TOKENIZER_FILES):
        args.tokenizer = str(folder)
