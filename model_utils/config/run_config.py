"""The resolved run config: the seven sections (config/sections.py) as one frozen run, and
what is derived from all of its fields at once.

The command line keeps the upstream recipe's flat flag names (`--hidden_width`, `--fp8`, `--lr`);
each flag is the field of the same name in exactly one section, so `--lr` is `config.optim.lr`
and a stage is handed its own section, not the whole run. Records (checkpoint.json's config,
metrics.jsonl's run record) keep the flat names (:meth:`Config.as_dict`), so the runs of every
version of the recipe compare and resume alike. The parser (arguments.py), docs/flags.md and
the resume rules (checkpoint/resume.py) read every field's declaration through flag_specs().
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from model_utils.config import sections
from model_utils.config.flag_spec import Resume, Spec, flag, spec_of
from model_utils.config.sections import SECTIONS

#: Flat field name -> its section.
SECTION_OF: dict[str, str] = {
    f.name: section for section, kind in SECTIONS.items() for f in fields(kind)
}


@dataclass(frozen=True)
class Config:
    """The run's config, resolved once (preset filled in, --model_impl auto and the FP8 recipe
    decided) and frozen: every stage reads the same values, and the records say what the run
    really used. A change (a resume's lr) is a new object from :meth:`replace`."""

    recipe: str | None = flag(
        "a named A/B recipe (e.g. llama3-8b-fp8 and its twin llama3-8b-bf16): its flags "
        "take this place on the command line; later flags override them",
        resume=Resume.EXPERIMENT,
    )
    # Its choices, presets.PRESETS' names, are the parser's (arguments.py).
    preset: str = flag("model shape and data defaults", resume=Resume.FREE, default="tiny")
    model: sections.ModelShape
    precision: sections.PrecisionConfig
    data: sections.DataConfig
    optim: sections.OptimConfig
    parallel: sections.ParallelConfig
    checkpoint: sections.CheckpointConfig
    run: sections.RunConfig
    #: The flags typed on the command line (a recipe's and a @FILE's included), not filled in
    #: by a default or a preset: on resume a typed --lr means "use this lr", a default does not.
    #: A fact about this launch, not about the run: never saved, no resume class.
    typed: frozenset[str] = dataclasses.field(default=frozenset(), compare=False, repr=False)

    @classmethod
    def from_flat(cls, values: Mapping[str, Any], typed: frozenset[str] = frozenset()) -> Config:
        """The sections from flat flag names (a parsed command line, a saved record); a name
        that belongs nowhere is an error: a flag must not be read by no one."""
        unknown = sorted(set(values) - set(SECTION_OF) - set(TOP_FIELDS))
        if unknown:
            raise AttributeError(f"no config section has field(s): {', '.join(unknown)}")
        parts: dict[str, Any] = {name: values.get(name) for name in TOP_FIELDS}
        for section, kind in SECTIONS.items():
            given = {f.name: values[f.name] for f in fields(kind) if f.name in values}
            parts[section] = kind(**given)
        return cls(**parts, typed=frozenset(typed))

    def as_dict(self) -> dict[str, Any]:
        """Every field under its flat flag name, as a new dict (checkpoint.json, metrics.jsonl)."""
        flat: dict[str, Any] = {name: getattr(self, name) for name in TOP_FIELDS}
        for section in SECTIONS:
            flat.update(dataclasses.asdict(getattr(self, section)))
        return flat

    @property
    def model_source(self) -> str:
        """What the model built is, in the words the user gave: `--init_from_hf DIR (N layers,
        hidden H)` for a checkpoint's config.json, else `--preset NAME` (the lines describing
        a run said `tiny`, the default preset, for a Llama 3 8B loaded from a folder)."""
        if self.checkpoint.init_from_hf:
            shape = self.model
            return (
                f"--init_from_hf {self.checkpoint.init_from_hf} ({shape.num_layers} layers, "
                f"hidden {shape.hidden_width})"
            )
        return f"--preset {self.preset}"

    def get(self, name: str) -> Any:
        """One field by its flat flag name (code that walks a list of flags, e.g. resume.py)."""
        if name in TOP_FIELDS:
            return getattr(self, name)
        return getattr(getattr(self, SECTION_OF[name]), name)

    def replace(self, **changes: Any) -> Config:
        """A copy with `changes`, by flat flag name; only existing fields (a typo must not add
        a new one)."""
        unknown = sorted(set(changes) - set(SECTION_OF) - set(TOP_FIELDS))
        if unknown:
            raise AttributeError(f"no such config field: {', '.join(unknown)}")
        return Config.from_flat({**self.as_dict(), **changes}, self.typed)


#: The fields of the run itself, beside the sections: what it was built from.
TOP_FIELDS = tuple(f.name for f in fields(Config) if f.name not in (*SECTIONS, "typed"))


def flag_specs() -> dict[str, Spec]:
    """Every field of the run -> its declaration, in the parser's order: the run's own fields
    (--recipe, --preset), then each section's (those no flag sets included)."""
    specs = {f.name: spec_of(f) for f in fields(Config) if f.name in TOP_FIELDS}
    for kind in SECTIONS.values():
        specs.update((f.name, spec_of(f)) for f in fields(kind))
    return specs


def resume_fields(resume: Resume) -> frozenset[str]:
    """The fields a resume treats as `resume` says (checkpoint/resume.py's rules)."""
    return frozenset(name for name, spec in flag_specs().items() if spec.resume is resume)


def saved_defaults() -> dict[str, Any]:
    """Field -> the value a checkpoint older than the field held (compared on resume as such)."""
    return {name: spec.before[0] for name, spec in flag_specs().items() if spec.before}


def refusal_words() -> dict[str, str]:
    """Fields that are no flag -> how a resume's refusal names them."""
    return {name: spec.words for name, spec in flag_specs().items() if spec.words}


def path_flags() -> tuple[str, ...]:
    """The flags naming files or folders: `~` is expanded even when the shell did not (quoted,
    or after `--flag=`), instead of becoming a folder literally named `~`."""
    return tuple(name for name, spec in flag_specs().items() if spec.path)
