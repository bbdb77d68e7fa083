"""Where our code uses Transformer Engine: every attribute chain, call (with its keywords)
and probe on the ``te`` / ``te_recipe`` aliases, collected from our source for the TE contract
(tests/integration/test_te_contract.py checks them against each release's source)."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Our TE code, the files collected.
OUR_SOURCES = (
    "te_llama.py",
    "model_utils/config/te_loader.py",
    "model_utils/model/te_support.py",
    "model_utils/precision/te.py",
    "model_utils/precision/te_state.py",
)
#: The names our TE code gives TE's modules (test_te_contract_rules checks the convention).
ALIASES = {"te": "transformer_engine.pytorch", "te_recipe": "transformer_engine.common.recipe"}


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


def _instances(tree: ast.AST) -> dict[str, tuple[str, list[str]]]:
    """Names a TE instance is stored under (``self.x = te.Cls(...)``) -> (module, chain)."""
    instances: dict[str, tuple[str, list[str]]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            chain = _chain(node.value.func)
            if chain:
                for target in node.targets:
                    instances[ast.unparse(target)] = chain
    return instances


def _is_probe(call: ast.Call) -> bool:
    """``hasattr(te, "name")`` or ``getattr(te, "name", ...)`` with a literal name."""
    return (
        isinstance(call.func, ast.Name)
        and call.func.id in ("hasattr", "getattr")
        and len(call.args) >= 2
        and isinstance(call.args[0], ast.Name)
        and call.args[0].id in ALIASES
        and isinstance(call.args[1], ast.Constant)
    )


def _is_called(node: ast.Attribute, parent: ast.AST | None) -> bool:
    """The attribute is called, or bound by ``partial`` (both are collected as calls)."""
    return isinstance(parent, ast.Call) and (
        parent.func is node
        or (ast.unparse(parent.func) in ("functools.partial", "partial") and parent.args[0] is node)
    )


def collect_usages(source: str, filename: str) -> list[Usage]:
    """Every use of TE in ``source``: attribute chains, calls with their keywords, calls on
    stored TE instances (``self.x = te.Cls(...)`` then ``self.x(...)`` -> ``Cls.forward``),
    and ``hasattr``/``getattr`` probes with a literal name."""
    tree = ast.parse(source, filename=filename)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    instances = _instances(tree)

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
            elif _is_probe(node):
                usages.append(
                    Usage(
                        f"{filename}:{node.lineno}", ALIASES[node.args[0].id], [node.args[1].value]
                    )
                )
        elif isinstance(node, ast.Attribute) and not isinstance(parents.get(node), ast.Attribute):
            chain = _chain(node)
            if chain and not _is_called(node, parents.get(node)):
                usages.append(Usage(f"{filename}:{node.lineno}", *chain))
    return usages


def our_usages() -> list[Usage]:
    usages = []
    for relative in OUR_SOURCES:
        usages += collect_usages((ROOT / relative).read_text(), relative)
    return usages
