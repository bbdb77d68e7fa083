"""The TE contract's own rules, without a TE wheel: the releases it covers (the double's and the
image's), the alias convention our TE code follows (``te`` is transformer_engine.pytorch,
``te_recipe`` its recipe module) and that the collector sees the calls that matter. The contract
against each release's source is tests/integration/test_te_contract.py.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from model_utils.precision import te as te_precision

ROOT = Path(__file__).resolve().parents[2]
OUR_SOURCES = (
    "te_llama.py",
    "model_utils/config/te_loader.py",
    "model_utils/model/te_support.py",
    "model_utils/precision/te.py",
    "model_utils/precision/te_state.py",
)
ALIASES = {"te": "transformer_engine.pytorch", "te_recipe": "transformer_engine.common.recipe"}
#: Calls whose result is bound to an alias in our source (checked by the convention test).
ALIAS_SOURCES = {"import_te()", "self._te()", "import_recipe_module()"}


# ------------------------------------------------------------------------------------------
# Our usages, from our source.
# ------------------------------------------------------------------------------------------


@dataclass
class Usage:
    where: str  # file:line
    module: str  # the TE module the chain starts from
    attrs: list[str]  # attribute chain
    method: str | None = None  # "forward" for calls on a stored TE instance
    keywords: list[str] | None = None  # None: not a call
    positional: int = 0
    forwarded_to: Usage | None = None  # checkpoint(fn=<TE instance>, ...): extra kwargs go here

    @property
    def label(self) -> str:
        return ".".join([self.module, *self.attrs]) + (f".{self.method}" if self.method else "")


def _chain(node: ast.AST) -> tuple[str, list[str]] | None:
    attrs: list[str] = []
    while isinstance(node, ast.Attribute):
        attrs.insert(0, node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in ALIASES and attrs:
        return ALIASES[node.id], attrs
    return None


def collect_usages(source: str, filename: str) -> list[Usage]:
    """Every use of TE in ``source``: attribute chains, calls with their keywords, calls on
    stored TE instances (``self.x = te.Cls(...)`` then ``self.x(...)`` -> ``Cls.forward``),
    and ``hasattr``/``getattr`` probes with a literal name."""
    tree = ast.parse(source, filename=filename)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    instances: dict[str, tuple[str, list[str]]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            chain = _chain(node.value.func)
            if chain:
                for target in node.targets:
                    instances[ast.unparse(target)] = chain

    def call_usage(call: ast.Call, module: str, attrs: list[str], method: str | None) -> Usage:
        usage = Usage(
            f"{filename}:{call.lineno}",
            module,
            attrs,
            method,
            [k.arg for k in call.keywords if k.arg is not None],
            sum(not isinstance(a, ast.Starred) for a in call.args),
        )
        if call.args and ast.unparse(call.args[0]) in instances:
            inner_module, inner_attrs = instances[ast.unparse(call.args[0])]
            usage.forwarded_to = Usage(usage.where, inner_module, inner_attrs, "forward", [], 0)
        return usage

    usages: list[Usage] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in (
            "functools.partial",
            "partial",
        ):
            chain = _chain(node.args[0]) if node.args else None
            if chain:  # partial(te.f, *args, kw=...) binds arguments of te.f
                bound = ast.Call(func=node.args[0], args=node.args[1:], keywords=node.keywords)
                usages.append(call_usage(ast.copy_location(bound, node), *chain, method=None))
        elif isinstance(node, ast.Call):
            chain = _chain(node.func)
            if chain:
                usages.append(call_usage(node, *chain, method=None))
            elif ast.unparse(node.func) in instances:
                usages.append(
                    call_usage(node, *instances[ast.unparse(node.func)], method="forward")
                )
            elif (
                isinstance(node.func, ast.Name)
                and node.func.id in ("hasattr", "getattr")
                and len(node.args) >= 2
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id in ALIASES
                and isinstance(node.args[1], ast.Constant)
            ):
                usages.append(
                    Usage(
                        f"{filename}:{node.lineno}", ALIASES[node.args[0].id], [node.args[1].value]
                    )
                )
        elif isinstance(node, ast.Attribute) and not isinstance(parents.get(node), ast.Attribute):
            chain = _chain(node)
            parent = parents.get(node)
            called = isinstance(parent, ast.Call) and (
                parent.func is node
                or (
                    ast.unparse(parent.func) in ("functools.partial", "partial")
                    and parent.args[0] is node
                )
            )
            if chain and not called:
                usages.append(Usage(f"{filename}:{node.lineno}", *chain))
    return usages


def our_usages() -> list[Usage]:
    usages = []
    for relative in OUR_SOURCES:
        usages += collect_usages((ROOT / relative).read_text(), relative)
    return usages


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
        "transformer_engine.common.recipe.DelayedScaling",
        "transformer_engine.common.recipe.Float8CurrentScaling",
        "transformer_engine.common.recipe.Float8BlockScaling",
        "transformer_engine.common.recipe.MXFP8BlockScaling",
    }
    assert expected <= labels, expected - labels
