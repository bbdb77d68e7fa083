"""The TE contract's own rules, without a TE wheel: the releases it covers (the double's and the
image's), the alias convention our TE code follows (``te`` is transformer_engine.pytorch,
``te_recipe`` its recipe module) and that the collector sees the calls that matter. The contract
against each release's source is tests/integration/test_te_contract.py.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from helpers.te_usages import ALIASES, OUR_SOURCES, our_usages

from model_utils.precision import te as te_precision

ROOT = Path(__file__).resolve().parents[2]
#: Calls whose result is bound to an alias in our source (checked by the convention test).
ALIAS_SOURCES = {"import_te()", "self._te()", "import_recipe_module()"}


# ------------------------------------------------------------------------------------------
# The rules (the collector of our usages: tests/helpers/te_usages.py).
# ------------------------------------------------------------------------------------------


def test_contract_covers_the_release_the_double_plays_and_the_image(te_double) -> None:
    """Every release the tests run against is contract-checked: the double's (the newest in the
    contract, whose signatures it mirrors) and the image's, the one the Dockerfile and
    docs/cluster.md name (major.minor)."""
    import transformer_engine

    versions = te_precision.TE_CONTRACT_VERSIONS
    assert len(set(versions)) == len(versions), versions  # each release fetched and checked once
    double = transformer_engine.__version__.split("+")[0]
    assert double in versions, (double, versions)
    newest = max(versions, key=lambda v: tuple(int(p) for p in v.split(".")))
    assert double == newest, f"the double mirrors {double}, the contract's newest is {newest}"
    assert te_precision.IMAGE_TE_VERSION in versions
    major_minor = ".".join(te_precision.IMAGE_TE_VERSION.split(".")[:2])
    for doc in ("0.transformer-engine.dockerfile", "docs/cluster.md"):
        text = " ".join((ROOT / doc).read_text().split())
        assert f"Transformer Engine {major_minor}" in text, doc


def test_our_source_follows_the_alias_convention() -> None:
    """``te``/``te_recipe`` are bound only from the TE accessors, so the collector is sound."""
    for relative in OUR_SOURCES:
        tree = ast.parse((ROOT / relative).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
                if set(names) & set(ALIASES):
                    assert ast.unparse(node.value) in ALIAS_SOURCES, f"{relative}:{node.lineno}"


def test_collector_sees_the_important_calls() -> None:
    labels = {u.label for u in our_usages() if u.keywords is not None}
    expected = {
        "transformer_engine.pytorch.TransformerLayer",
        "transformer_engine.pytorch.TransformerLayer.forward",
        "transformer_engine.pytorch.Linear",
        "transformer_engine.pytorch.checkpoint",
        "transformer_engine.pytorch.autocast",
        "transformer_engine.pytorch.fp8_autocast",
        "transformer_engine.pytorch.quantized_model_init",
        "transformer_engine.pytorch.fp8_model_init",
    }
    assert expected <= labels, expected - labels
    # The recipe classes are built by name from config/options.FP8_RECIPES' rows, which
    # test_te_contract walks against TE's source and the double (classes and keywords).


def test_each_fp8_recipe_is_one_row_the_rest_derives_from() -> None:
    """config/options.FP8_RECIPES: the flags' choices, each backend's default (its first row),
    the options each recipe reads, its FP8 attention path and its requirements come from the
    rows; a TE row names its class and TE's availability check, and reads only TE recipe flags
    of the precision section."""
    from model_utils.config import options
    from model_utils.config.sections import PrecisionConfig
    from model_utils.precision import te_requirements

    rows = options.FP8_RECIPES
    assert options.TORCHAO_RECIPES[0] == "tensorwise" and options.TE_RECIPES[0] == "delayed"
    assert set(options.TORCHAO_RECIPES) | set(options.TE_RECIPES) == {r.name for r in rows}
    flags = {f.name for f in dataclasses.fields(PrecisionConfig)}
    for row in rows:
        if row.backend == "torchao":
            assert (row.te_class, row.knobs, row.attention, row.te_check) == (None, (), False, None)
            continue
        assert row.te_class and row.te_check and set(row.knobs) <= set(options.TE_RECIPE_KEYWORDS)
        assert set(row.knobs) <= flags and "fp8_format" in row.knobs
        need = te_requirements.REQUIREMENTS[row.name]
        assert (need.min_sm, need.min_cuda, need.min_te) == (row.min_sm, row.min_cuda, row.min_te)
        for knob in row.knobs:
            assert row.name in options.TE_RECIPE_OPTIONS[knob]
    assert options.FP8_ATTENTION_RECIPES == ("delayed", "current")
