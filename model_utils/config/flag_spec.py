"""A flag declared once, on the config field that holds it (config/sections.py).

The field's metadata carries the flag's help, default, choices, range, whether it names a path,
what it needs and excludes of the other flags, and what a resume may do with it; its type
annotation is the flag's type. The parser (arguments.py), docs/flags.md, the range checks and
the refusals between flags (flag_rules.py) and the resume rules (checkpoint/resume.py) are read
from there, so a new flag is one field, and a field that says nothing about resume fails at
once instead of becoming "a resume may change it" by omission.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_KEY = "flag"


class Resume(enum.Enum):
    """What a resume may do with a field's value (checkpoint/resume.py applies it)."""

    #: The model's shape, the data stream and the optimizer's stored format: a checkpoint
    #: resumes only the same model (other shapes may still load when the tensors happen to fit),
    #: on the same data (a saved position means nothing in another dataset, tokenizer or
    #: shuffle), with its optimizer state in the format it was written in. Also what loading
    #: the optimizer and schedule puts back (AdamW's betas and decay, the warm-up and decay
    #: style): a changed value would be recorded but never used. Refused on change.
    KEPT = "kept"
    #: What makes the run the experiment it is: its precision (what an fp8/bf16 A/B compares),
    #: the --recipe it was launched as. A resume of the run's own checkpoints that changed it
    #: would continue one experiment under another's name. Refused within the same run; another
    #: run's checkpoint loaded into a new folder starts a new run from its weights (logged).
    EXPERIMENT = "experiment"
    #: An FP8 recipe knob that changes the GEMMs' numerics: as EXPERIMENT, but only while FP8 is
    #: on in the checkpoint and in this run (with --fp8=0 its value trains nothing).
    FP8_KNOB = "fp8_knob"
    #: Names this launch rather than the run (or has a rule of its own): never compared.
    LAUNCH = "launch"
    #: A resume may change it (the batch, the context, what observes the run): logged.
    FREE = "free"


@dataclass(frozen=True)
class Range:
    """The numbers a flag takes: `low` <(=) value <(=) `high`, finite, or exactly `off`.

    `words` is the refusal when the generic "--NAME must be > 0, got V" says less; it is
    formatted with `flag`, `value` and the run's other values by name."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    off: float | None = None
    words: str | None = None

    def holds(self, value: float) -> bool:
        if self.off is not None and value == self.off:
            return True
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def problem(self, flag: str, value: float | None, values: Mapping[str, Any]) -> str | None:
        """The one-line refusal of `value` (None: it holds, or the flag is unset)."""
        if value is None or self.holds(value):
            return None
        if self.words:
            return self.words.format(**{**values, "flag": flag, "value": value})
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"{flag} must be in {left}{self.low}, {self.high}{right}, got {value}"
        if self.low is not None:
            bound = f"{'>' if self.low_open else '>='} {self.low}"
        else:
            bound = f"{'<' if self.high_open else '<='} {self.high}"
        finite = "" if math.isfinite(value) else "a finite number "
        return f"{flag} must be {finite}{bound}, got {value}"


POSITIVE = Range(low=0, low_open=True)
NOT_NEGATIVE = Range(low=0)


@dataclass(frozen=True)
class When:
    """A condition on another field of the run, in the words a user reads: `field` holds `value`
    (or passes `test`); `words` names it (default `--field`, `no --field` or `--field value`);
    `why` is what the flag does that needs or excludes it, said in the refusal (formatted with
    the run's values by name). `field` may also be `cuda`: this machine has a CUDA GPU."""

    field: str
    value: Any = True
    words: str | None = None
    why: str = ""
    test: Callable[[Any], bool] | None = None

    @staticmethod
    def because(why: str, *conditions: When) -> tuple[When, ...]:
        """`conditions`, each with the words of why the flag declaring them needs (excludes)
        it."""
        return tuple(dataclasses.replace(condition, why=why) for condition in conditions)

    def holds(self, values: Mapping[str, Any]) -> bool:
        got = values[self.field]
        return self.test(got) if self.test else got == self.value

    @property
    def named(self) -> str:
        if self.words:
            return self.words
        if isinstance(self.value, bool):
            return f"{'' if self.value else 'no '}--{self.field}"
        return f"--{self.field} {self.value}"


@dataclass(frozen=True)
class Spec:
    """One config field's declaration. `help` None: no flag sets the field (a preset,
    --init_from_hf's config.json or train.validate fills it in)."""

    resume: Resume
    help: str | None = None
    default: Any = None
    choices: Sequence[Any] | None = None
    ranges: tuple[Range, ...] = ()
    path: bool = False
    nonempty: bool = False
    metavar: str | None = None
    before: tuple[Any, ...] = ()
    words: str | None = None
    needs: tuple[When, ...] = ()
    excludes: tuple[When, ...] = ()

    @property
    def is_flag(self) -> bool:
        return self.help is not None

    def pairing_problem(self, name: str, values: Mapping[str, Any]) -> str | None:
        """The one-line refusal of flag `name` given (off its default) where a condition it
        needs does not hold, or one it excludes does (None: fine). Every missing need is named."""
        if values[name] == self.default:
            return None
        given = f"--{name} {values[name]}" if self.choices else f"--{name}"
        missing = [need for need in self.needs if not need.holds(values)]
        if missing:
            *most, last = [need.named for need in missing]
            words, why = f"{', '.join(most)} and {last}" if most else last, missing[0].why
            why = why.format(**values)
            return f"{given} {why}: it needs {words}" if why else f"{given} needs {words}"
        for other in self.excludes:
            if other.holds(values):
                why = other.why.format(**values) or f"excludes {other.named}"
                return f"{given} {why}: drop one of them"
        return None


def flag(
    help: str,
    *,
    resume: Resume,
    default: Any = None,
    choices: Sequence[Any] | None = None,
    range: Range | tuple[Range, ...] = (),
    path: bool = False,
    nonempty: bool = False,
    metavar: str | None = None,
    before: tuple[Any, ...] = (),
    needs: tuple[When, ...] = (),
    excludes: tuple[When, ...] = (),
    field_default: Any = dataclasses.MISSING,
) -> Any:
    """A section field that is the flag of the same name.

    `default`: the flag's (None: unset, filled in by a preset or another flag). `path`: names a
    file or folder (`~` expanded, empty or over-long names refused); `nonempty`: an empty
    string is refused. `before`: (value,) a checkpoint older than the flag held, compared as
    such on resume. `needs` / `excludes`: what must (must not) hold of the other flags when
    this one is given. `field_default`: what a record without the field reads back as."""
    ranges = range if isinstance(range, tuple) else (range,)
    pairs = {"needs": needs, "excludes": excludes}
    spec = Spec(resume, help, default, choices, ranges, path, nonempty, metavar, before, **pairs)
    return dataclasses.field(default=field_default, metadata={_KEY: spec})


def derived(
    resume: Resume, *, words: str | None = None, field_default: Any = dataclasses.MISSING
) -> Any:
    """A section field that no flag sets. `words`: how a resume's refusal names it; a field
    with words is measured, and not compared where one side did not measure it (None)."""
    return dataclasses.field(default=field_default, metadata={_KEY: Spec(resume, words=words)})


def spec_of(field: dataclasses.Field) -> Spec:
    """The field's declaration; a field declared without flag() or derived() is an error at
    once: what a resume may do with it must be said, not assumed."""
    if _KEY not in field.metadata:
        raise TypeError(
            f"config field {field.name} is declared without flag(...) or derived(...) "
            "(config/flag_spec.py): give it its help and its resume class"
        )
    return field.metadata[_KEY]
