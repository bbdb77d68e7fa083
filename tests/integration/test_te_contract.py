"""API contract with the Transformer Engine releases we support, checked without importing TE.

The releases are ``te_precision.TE_CONTRACT_VERSIONS``: the newest (``PINNED_TE_VERSION``) and the
one the GPU image ships (``IMAGE_TE_VERSION``); every contract test runs against each.
``tools/fetch_te_wheel.sh VERSION`` downloads that pure-Python ``transformer-engine`` wheel
(``pip download --no-deps``); its source is parsed with ``ast``. Every TE name, attribute and
keyword argument used by ``te_llama.py`` and the package's TE modules
(``test_te_contract_rules.OUR_SOURCES``) is collected from
*our* source with ``ast`` as well, so the check follows the code: a misspelt keyword, a class
TE renamed, or a ``forward`` argument TE dropped fails here. The TE test double's signatures
are compared with the pinned release's, so tests that pass on the double pass the calls TE takes.

Conventions the collector relies on (asserted below): a name ``te`` is bound only to
``transformer_engine.pytorch`` and ``te_recipe`` only to ``transformer_engine.common.recipe``.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.te_usages import Usage, collect_usages, our_usages

from model_utils.config.flag_spec import spec_of
from model_utils.config.fp8_plan import te_options
from model_utils.config.options import FP8_RECIPES, TE_RECIPE_KEYWORDS
from model_utils.config.sections import PrecisionConfig
from model_utils.precision import te as te_precision
from model_utils.precision import te_requirements
from model_utils.precision.te_requirements import TE_UNSAFE_PICKLE_ENV

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------
# The real TE source, from the wheel.
# ------------------------------------------------------------------------------------------


class TESource:
    """Module name -> parsed AST of every ``.py`` file in a TE wheel, with name resolution."""

    def __init__(self, wheel: Path) -> None:
        self.modules: dict[str, ast.Module] = {}
        self.version = ""  # from the wheel's METADATA
        with zipfile.ZipFile(wheel) as archive:
            for name in archive.namelist():
                if name.startswith("transformer_engine/") and name.endswith(".py"):
                    module = name[: -len(".py")].replace("/", ".").removesuffix(".__init__")
                    self.modules[module] = ast.parse(archive.read(name), filename=name)
                elif name.endswith(".dist-info/METADATA"):
                    for line in archive.read(name).decode().splitlines():
                        if line.startswith("Version:"):
                            self.version = line.split(":", 1)[1].strip()

    def resolve(self, module: str, name: str, depth: int = 0) -> tuple[str, Any] | None:
        """Where ``module.name`` is defined: ``("module", modname)``, ``(modname, def_node)``."""
        if depth > 20 or module not in self.modules:
            return None
        for node in self.modules[module].body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name:
                return module, node
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) != name:
                        continue
                    source = self._absolute(module, node)
                    found = self.resolve(source, alias.name, depth + 1)
                    if found is None and f"{source}.{alias.name}" in self.modules:
                        return "module", f"{source}.{alias.name}"
                    return found
        if f"{module}.{name}" in self.modules:
            return "module", f"{module}.{name}"
        return None

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        is_package = any(m.startswith(module + ".") for m in self.modules)
        parts = module.split(".")
        base = parts if is_package else parts[:-1]
        base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
        return ".".join(base + ([node.module] if node.module else []))

    def resolve_chain(self, module: str, attrs: list[str]) -> tuple[str, Any] | None:
        """Follow ``module.a.b.c``: through submodules, re-exports and class members."""
        current: tuple[str, Any] | None = ("module", module)
        for attr in attrs:
            if current is None:
                return None
            where, what = current
            if where == "module":
                current = self.resolve(what, attr)
            elif isinstance(what, ast.ClassDef):
                current = class_member(what, attr, where)
            else:
                return None
        return current


def class_member(cls: ast.ClassDef, name: str, module: str) -> tuple[str, Any] | None:
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return module, node
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return module, node
    return None


def is_dataclass_node(cls: ast.ClassDef) -> bool:
    for deco in cls.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        if ast.unparse(target).split(".")[-1] == "dataclass":
            return True
    return False


@dataclass
class Params:
    """What a callable accepts: ordered named parameters and their literal defaults."""

    positional: list[str]
    keyword_only: list[str]
    varargs: bool
    varkw: bool
    popped: set[str] = field(default_factory=set)  # keys a **kwargs body pops/gets by name
    defaults: dict[str, Any] = field(default_factory=dict)  # literal defaults only

    @property
    def names(self) -> list[str]:
        return self.positional + self.keyword_only


_NO_LITERAL = object()


def _literal(node: ast.AST | None) -> Any:
    try:
        return ast.literal_eval(node) if node is not None else _NO_LITERAL
    except ValueError:
        return ast.unparse(node)  # e.g. "Format.HYBRID": compared as text


def function_params(func: ast.FunctionDef, drop_self: bool) -> Params:
    args = func.args
    positional = [a.arg for a in args.posonlyargs + args.args]
    if drop_self and positional and positional[0] in ("self", "cls"):
        positional = positional[1:]
    defaults: dict[str, Any] = {}
    for arg, default in zip(args.args[::-1], args.defaults[::-1], strict=False):
        defaults[arg.arg] = _literal(default)
    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        if default is not None:
            defaults[arg.arg] = _literal(default)
    popped: set[str] = set()
    if args.kwarg:
        for node in ast.walk(func):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("pop", "get")
                and ast.unparse(node.func.value) == args.kwarg.arg
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                popped.add(node.args[0].value)
    return Params(
        positional,
        [a.arg for a in args.kwonlyargs],
        args.vararg is not None,
        args.kwarg is not None,
        popped,
        defaults,
    )


def callable_params(resolved: tuple[str, Any], method: str | None = None) -> Params | None:
    """Parameters of a function, a class's constructor (dataclass fields) or ``method``."""
    module, node = resolved
    if isinstance(node, ast.FunctionDef):
        return function_params(node, drop_self=False)
    if not isinstance(node, ast.ClassDef):
        return None
    if method is None and is_dataclass_node(node):
        fields = [
            n for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
        ]
        names = [f.target.id for f in fields if "ClassVar" not in ast.unparse(f.annotation)]
        defaults = {f.target.id: _literal(f.value) for f in fields if f.value is not None}
        return Params(names, [], False, False, set(), defaults)
    member = class_member(node, method or "__init__", module)
    if member is None or not isinstance(member[1], ast.FunctionDef):
        return None
    return function_params(member[1], drop_self=True)


# ------------------------------------------------------------------------------------------
# Our usages, from our source.
# ------------------------------------------------------------------------------------------


def check_usage(te: TESource, usage: Usage) -> list[str]:
    """Problems with one usage against the real TE source (empty list = fine)."""
    resolved = te.resolve_chain(usage.module, usage.attrs)
    if resolved is None:
        return [f"{usage.where}: {usage.label} does not exist in Transformer Engine"]
    if usage.keywords is None:
        return []
    params = callable_params(resolved, usage.method)
    if params is None:
        return [f"{usage.where}: {usage.label} is not callable in Transformer Engine"]
    problems = []
    if not params.varargs and usage.positional > len(params.positional):
        problems.append(f"{usage.where}: {usage.label} takes {len(params.positional)} positional")
    forward = None
    if usage.forwarded_to is not None:
        target = te.resolve_chain(usage.forwarded_to.module, usage.forwarded_to.attrs)
        forward = callable_params(target, "forward") if target else None
    for keyword in usage.keywords:
        if keyword in params.names or keyword in params.popped:
            continue
        if params.varkw and forward is not None and keyword in forward.names:
            continue  # passed through to the wrapped TE module's forward
        if params.varkw and not params.popped and forward is None:
            continue  # an opaque **kwargs: nothing to check against
        problems.append(f"{usage.where}: {usage.label} has no keyword argument {keyword!r}")
    return problems


# ------------------------------------------------------------------------------------------
# Fixtures.
# ------------------------------------------------------------------------------------------


@functools.cache
def load_te_source(version: str) -> TESource:
    """The parsed wheel of TE ``version`` (downloaded once, then cached on disk and here)."""
    result = subprocess.run(
        ["bash", str(ROOT / "tools" / "fetch_te_wheel.sh"), version],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if result.returncode == 3:
        pytest.skip(
            "!!! TE CONTRACT NOT CHECKED: PyPI is unreachable, so the "
            f"transformer-engine=={version} wheel could not be downloaded !!!\n{result.stderr}"
        )
    assert result.returncode == 0, f"fetch_te_wheel.sh {version} failed:\n{result.stderr}"
    return TESource(Path(result.stdout.strip().splitlines()[-1]))


@pytest.fixture(scope="module", params=te_precision.TE_CONTRACT_VERSIONS)
def te_source(request: pytest.FixtureRequest) -> TESource:
    """Each supported TE release in turn: the newest, and the one the GPU image ships."""
    return load_te_source(request.param)


@pytest.fixture(scope="module")
def pinned_te_source() -> TESource:
    """The release the TE test double mirrors."""
    return load_te_source(te_precision.PINNED_TE_VERSION)


# ------------------------------------------------------------------------------------------
# The contract.
# ------------------------------------------------------------------------------------------


def test_wheel_is_the_requested_release(te_source: TESource, request) -> None:
    assert te_source.version == request.node.callspec.params["te_source"]
    assert "transformer_engine.pytorch.transformer" in te_source.modules
    assert te_source.resolve("transformer_engine.pytorch", "TransformerLayer") is not None


def test_every_te_name_and_keyword_we_use_exists(te_source: TESource) -> None:
    problems = [p for usage in our_usages() for p in check_usage(te_source, usage)]
    assert not problems, "\n".join(problems)


def test_names_kept_as_data_exist(te_source: TESource) -> None:
    """Each TE row of config/options.FP8_RECIPES against TE's source: its recipe class, a
    keyword of that class for each flag it reads (and ``fp8_dpa`` where it has FP8 attention),
    its availability check; and the Format members the flags choose."""
    recipe_module = "transformer_engine.common.recipe"
    for row in (r for r in FP8_RECIPES if r.backend == "te"):
        cls = te_source.resolve(recipe_module, row.te_class)
        assert cls, row.te_class
        keywords = recipe_keywords(te_source, cls)
        # the flags the row reads -> their TE keywords: the one list build_recipe passes
        read = te_options(row, TE_RECIPE_KEYWORDS)
        missing = [keyword for keyword in read.values() if keyword not in keywords]
        assert not missing, (row.name, row.te_class, missing)
        check = te_source.resolve("transformer_engine.pytorch", row.te_check)
        assert check and "return_reason" in callable_params(check).names, row.te_check
    for member in te_precision.TE_FORMATS.values():
        assert te_source.resolve_chain(recipe_module, ["Format", member]), member


def recipe_keywords(te_source: TESource, resolved: tuple[str, Any]) -> set[str]:
    """A recipe dataclass's fields, its base classes' included."""
    module, node = resolved
    params = callable_params(resolved)  # None for a base that is no dataclass
    names = set(params.names) if params else set()
    for base in node.bases:
        found = te_source.resolve(module, ast.unparse(base))
        if found and isinstance(found[1], ast.ClassDef):
            names |= recipe_keywords(te_source, found)
    return names


SYNTHETIC = """
te = import_te()
te_recipe = import_recipe_module()
layer = te.TransformerLayer(hidden_size=8, ffn_hidden_size=8, num_attention_heads=2, {init_kw}=2)
layer(x, {forward_kw}=None)
te.checkpoint(layer, x, use_reentrant=False, {forwarded_kw}=None)
te_recipe.DelayedScaling({recipe_kw}=16)
te.{function}(enabled=True)
functools.partial(te.checkpoint, {partial_kw}=False)
"""
CORRECT = dict(
    init_kw="num_gqa_groups",
    forward_kw="rotary_pos_emb",
    forwarded_kw="is_first_microbatch",
    recipe_kw="amax_history_len",
    function="autocast",
    partial_kw="use_reentrant",
)


def synthetic_problems(te_source: TESource, **changes: str) -> list[str]:
    source = SYNTHETIC.format(**{**CORRECT, **changes})
    return [p for u in collect_usages(source, "synthetic.py") for p in check_usage(te_source, u)]


def test_correct_synthetic_usage_passes(te_source: TESource) -> None:
    assert synthetic_problems(te_source) == []


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"init_kw": "num_gqa_group"}, "TransformerLayer has no keyword argument 'num_gqa_group'"),
        ({"forward_kw": "rotary_pos_embs"}, "forward has no keyword argument 'rotary_pos_embs'"),
        ({"forwarded_kw": "is_first_micro_batch"}, "no keyword argument 'is_first_micro_batch'"),
        ({"recipe_kw": "amax_history_length"}, "DelayedScaling has no keyword argument"),
        ({"function": "fp8_autocastt"}, "fp8_autocastt does not exist"),
        ({"partial_kw": "use_reentrnt"}, "checkpoint has no keyword argument 'use_reentrnt'"),
    ],
)
def test_a_misspelling_is_caught(te_source: TESource, change: dict, expected: str) -> None:
    problems = synthetic_problems(te_source, **change)
    assert len(problems) == 1 and expected in problems[0], problems


# ------------------------------------------------------------------------------------------
# The double mirrors the real signatures.
# ------------------------------------------------------------------------------------------


def _double_object(module: str, attrs: list[str]) -> Any:
    import importlib

    obj: Any = importlib.import_module(module)
    for attr in attrs:
        obj = getattr(obj, attr)
    return obj


def _double_params(obj: Any, method: str | None) -> tuple[list[str], dict[str, Any]]:
    if inspect.isclass(obj) and method is None and dataclasses.is_dataclass(obj):
        fields = dataclasses.fields(obj)
        defaults = {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}
        return [f.name for f in fields], defaults
    target = getattr(obj, method or "__init__") if inspect.isclass(obj) else obj
    signature = inspect.signature(target)
    names = [
        n
        for n, p in signature.parameters.items()
        if n not in ("self", "cls") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    defaults = {
        n: p.default
        for n, p in signature.parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    return names, defaults


def _same_default(real: Any, double: Any) -> bool:
    if real is _NO_LITERAL:
        return True
    if isinstance(real, str) and isinstance(double, torch.dtype):  # torch.float32
        return real == str(double)
    if isinstance(real, str) and "." in real and hasattr(double, "name"):  # Format.HYBRID
        return real.split(".")[-1] == double.name
    if isinstance(real, str) and ("(" in real or real.isidentifier()):  # computed: not comparable
        return True
    return real == double


def test_double_signatures_match_the_real_ones(pinned_te_source: TESource, te_double) -> None:
    import transformer_engine

    te_source = pinned_te_source

    assert transformer_engine.__version__.split("+")[0] == te_precision.PINNED_TE_VERSION
    checked = set()
    problems = []
    for usage in our_usages():
        targets = [usage] + ([usage.forwarded_to] if usage.forwarded_to else [])
        for target in targets:
            if target.keywords is None and target is usage or target.label in checked:
                continue
            checked.add(target.label)
            resolved = te_source.resolve_chain(target.module, target.attrs)
            real = callable_params(resolved, target.method)
            names, defaults = _double_params(
                _double_object(target.module, target.attrs), target.method
            )
            if names != real.names:
                problems.append(f"{target.label}: double {names} != real {real.names}")
                continue
            for name, default in real.defaults.items():
                if not _same_default(default, defaults.get(name, _NO_LITERAL)):
                    problems.append(
                        f"{target.label}({name}=): double {defaults.get(name)!r} != {default!r}"
                    )
    recipe_module = "transformer_engine.common.recipe"
    for row in (r for r in FP8_RECIPES if r.backend == "te"):  # built from the table, by name
        real = callable_params(te_source.resolve(recipe_module, row.te_class))
        names, defaults = _double_params(_double_object(recipe_module, [row.te_class]), None)
        checked.add(f"{recipe_module}.{row.te_class}")
        if names != real.names:
            problems.append(f"{row.te_class}: double {names} != real {real.names}")
        for name, default in real.defaults.items():
            if not _same_default(default, defaults.get(name, _NO_LITERAL)):
                problems.append(f"{row.te_class}({name}=): double {defaults.get(name)!r}")
    assert len(checked) >= 12
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------
# FP8 scaling state: the TE internals te_llama reads and writes, and TE's pickle policy.
# ------------------------------------------------------------------------------------------


def _class_node(source: TESource, module: str, name: str) -> ast.ClassDef:
    node = next(
        (n for n in source.modules[module].body if isinstance(n, ast.ClassDef) and n.name == name),
        None,
    )
    assert node is not None, f"{module}.{name} not found"
    return node


def _self_attributes(node: ast.ClassDef) -> set[str]:
    return {
        target.attr
        for stmt in ast.walk(node)
        if isinstance(stmt, (ast.Assign, ast.AnnAssign))
        for target in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target])
        if isinstance(target, ast.Attribute)
        and isinstance(target.value, ast.Name)
        and target.value.id == "self"
    }


def _source_text(source: TESource, module: str) -> str:
    return ast.unparse(source.modules[module])


def test_fp8_state_internals_exist(te_source: TESource) -> None:
    """te_state.fp8_scaling_state/load_fp8_scaling_state use TE's module attributes directly:
    ``fp8_meta["scaling_fwd"|"scaling_bwd"]`` holding a DelayedScalingRecipeState with ``scale``
    and ``amax_history``, ``init_fp8_meta_tensors(recipe)`` and ``num_gemms`` (3 forward and 2
    backward quantizers per GEMM, which is how the GEMM count is recovered from a saved scale)."""
    base = _class_node(
        te_source, "transformer_engine.pytorch.module.base", "TransformerEngineBaseModule"
    )
    methods = {n.name for n in base.body if isinstance(n, ast.FunctionDef)}
    assert {"init_fp8_meta_tensors", "get_extra_state", "set_extra_state"} <= methods
    base_text = _source_text(te_source, "transformer_engine.pytorch.module.base")
    for needle in ('"scaling_fwd"', '"scaling_bwd"', "['num_gemms'] * 3", "['num_gemms'] * 2"):
        assert needle.replace('"', "'") in base_text, needle
    state = _class_node(
        te_source, "transformer_engine.pytorch.quantization", "DelayedScalingRecipeState"
    )
    assert {"scale", "amax_history"} <= _self_attributes(state)
    recipe = _class_node(te_source, "transformer_engine.common.recipe", "Recipe")
    assert "delayed" in {n.name for n in recipe.body if isinstance(n, ast.FunctionDef)}


def _calls(node: ast.AST, name: str) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(node)
        if isinstance(n, ast.Call) and ast.unparse(n.func).split(".")[-1] == name
    ]


def _guards_of(tree: ast.AST, call: ast.Call) -> list[str]:
    """The conditions of the ``if`` statements whose body holds ``call``."""
    return [
        ast.unparse(n.test)
        for n in ast.walk(tree)
        if isinstance(n, ast.If) and any(c is call for s in n.body for c in ast.walk(s))
    ]


def test_delayed_scaling_updates_where_the_double_updates(te_source: TESource) -> None:
    """The TE double updates delayed-scaling state at TE's three points (its module docstring),
    which decide what a checkpoint holds and how often a history rolls:

    * the outermost ``autocast`` exit, with grad enabled, reduces and updates the forward state
      (``autocast_exit``), and entering the outermost one arms ``is_first_fp8_module``;
    * the first FP8 module's backward, the last to run, ends with the backward update
      (``Linear``, ``LayerNormLinear``, ``LayerNormMLP``);
    * TE's non-reentrant ``checkpoint`` recomputes inside an ``autocast`` of its own, so every
      recomputed layer's exit updates the forward state again.
    """
    quantization = "transformer_engine.pytorch.quantization"
    manager = _class_node(te_source, quantization, "FP8GlobalStateManager")
    methods = {n.name: n for n in manager.body if isinstance(n, ast.FunctionDef)}
    enter = ast.unparse(methods["autocast_enter"])
    assert "if qstate.autocast_depth == 0:\n        qstate.is_first_fp8_module = True" in enter
    exit_ = methods["autocast_exit"]
    (forward_update,) = _calls(exit_, "reduce_and_update_fp8_tensors")
    assert ast.unparse(forward_update.keywords[0]) == "forward=True"
    (guard,) = _guards_of(exit_, forward_update)
    for part in ("enabled", "qstate.autocast_depth == 0", "not _graph", "torch.is_grad_enabled()"):
        assert part in guard, guard
    for module in ("linear", "layernorm_linear", "layernorm_mlp"):
        tree = te_source.modules[f"transformer_engine.pytorch.module.{module}"]
        updates = _calls(tree, "reduce_and_update_fp8_tensors")
        assert [ast.unparse(c.keywords[0]) for c in updates] == ["forward=False"], module
        assert _calls(tree, "is_first_fp8_module"), module
    distributed = te_source.modules["transformer_engine.pytorch.distributed"]
    checkpoint = next(
        n for n in distributed.body if isinstance(n, ast.FunctionDef) and n.name == "checkpoint"
    )
    recompute = next(
        n
        for n in ast.walk(checkpoint)
        if isinstance(n, ast.FunctionDef) and n.name == "recompute_fn"
    )
    (entered,) = _calls(recompute, "autocast")
    assert ast.unparse(entered) == "autocast(enabled=fp8, recipe=fp8_recipe)"


def test_the_fused_mlp_recompute_flag_exists(te_source: TESource, te_double) -> None:
    """``--ac_scope mlp`` on ``--model_impl te`` sets ``layernorm_mlp.checkpoint`` on a built
    ``TransformerLayer`` (distributed.MLP_SITES). That holds only while TransformerLayer keeps its
    MLP as ``self.layernorm_mlp``, a ``LayerNormMLP`` it calls in forward, and LayerNormMLP
    takes ``checkpoint`` (default off, as in the double), stores it, and hands ``self.checkpoint``
    to its autograd function at every forward (TE PR #2311, released in 2.11)."""
    from transformer_engine.pytorch import TransformerLayer as DoubleLayer

    import te_llama
    from model_utils.parallel import distributed

    module = "transformer_engine.pytorch.module.layernorm_mlp"
    mlp = _class_node(te_source, module, "LayerNormMLP")
    init = next(n for n in mlp.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    params = function_params(init, drop_self=True)
    assert "checkpoint" in params.names and params.defaults["checkpoint"] is False
    assert "checkpoint" in _self_attributes(mlp)
    forward = next(n for n in mlp.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    assert "self.checkpoint" in ast.unparse(forward)
    layer = _class_node(te_source, "transformer_engine.pytorch.transformer", "TransformerLayer")
    text = ast.unparse(layer)
    assert "self.layernorm_mlp = LayerNormMLP(" in text
    assert "self.layernorm_mlp(hidden_states" in text
    path = next(p for p, how in distributed.MLP_SITES.items() if how == "te_flag")
    assert path == f"{te_llama.TE_LAYER_ATTR}.layernorm_mlp"  # te_llama's attribute, then TE's
    built = DoubleLayer(
        64,
        128,
        4,
        bias=False,
        activation="swiglu",
        normalization="RMSNorm",
        attn_input_format="bshd",
        fuse_qkv_params=True,
        qkv_weight_interleaved=False,
        device="cpu",
    )
    assert built.layernorm_mlp.checkpoint is False


def test_pickled_extra_state_refusal_matches_the_release(
    te_source: TESource, pinned_te_source: TESource, te_double
) -> None:
    """TE refuses pickled delayed-scaling extra state from the release in
    te_requirements.TE_REFUSES_PICKLED_EXTRA_STATE on, under the variable the recipe names; the
    double's advisory is TE's, word for word (for the pinned release)."""
    from transformer_engine.pytorch import _extra_state as double

    module = "transformer_engine.pytorch._extra_state"
    release = tuple(int(p) for p in te_source.version.split(".")[:2])
    refuses = release >= te_requirements.TE_REFUSES_PICKLED_EXTRA_STATE
    assert (module in te_source.modules) == refuses
    if not refuses:
        return
    text = _source_text(te_source, module)
    assert f"UNSAFE_PICKLE_EXTRA_STATE_ENV = '{TE_UNSAFE_PICKLE_ENV}'" in text
    assert "def should_load_extra_state_pickle(data: bytes, context: str) -> bool" in text
    for recipe, policy in (("DelayedScaling", "STATEFUL"), ("Float8CurrentScaling", "STATELESS")):
        assert f"(_RECIPE_MODULE, '{recipe}'): CheckpointExtraStatePolicy.{policy}" in text
    advisory = next(
        n
        for n in ast.walk(pinned_te_source.modules[module])
        if isinstance(n, ast.FunctionDef) and n.name == "extra_state_pickle_advisory"
    )
    returned = next(n for n in ast.walk(advisory) if isinstance(n, ast.Return)).value
    names = {"context": "LayerNormLinear", "UNSAFE_PICKLE_EXTRA_STATE_ENV": TE_UNSAFE_PICKLE_ENV}
    real = eval(compile(ast.Expression(returned), "advisory", "eval"), names)  # an f-string
    assert double.extra_state_pickle_advisory("LayerNormLinear") == real
    assert double.UNSAFE_PICKLE_EXTRA_STATE_ENV == TE_UNSAFE_PICKLE_ENV


def test_fused_adam_keeps_the_state_our_master_weight_adamw_keeps(te_source: TESource) -> None:
    """``--master_weights optimizer`` runs TE's FusedAdam on CUDA and MasterWeightAdamW elsewhere,
    and their checkpoints are meant to be one format: per parameter the states named in
    FusedAdam's ``name_to_dtype_map`` (master_weights.STATE_NAMES), one ``group["step"]`` per
    parameter group, and a ``load_state_dict`` of its own that sets the saved fp32 states again
    (torch's would cast them to the bf16 parameter's dtype; ours overrides it for that reason)."""
    from model_utils.precision.master_weights import STATE_NAMES

    fused = _class_node(te_source, "transformer_engine.pytorch.optimizers.fused_adam", "FusedAdam")
    methods = {n.name: n for n in fused.body if isinstance(n, ast.FunctionDef)}
    assert {"step", "state_dict", "load_state_dict", "initialize_state"} <= set(methods)
    maps = [
        node.value
        for node in ast.walk(methods["__init__"])
        if isinstance(node, ast.Assign)
        and ast.unparse(node.targets[0]) == "self.name_to_dtype_map"
        and isinstance(node.value, ast.Dict)
    ]
    assert len(maps) == 1
    assert {ast.literal_eval(key) for key in maps[0].keys} == set(STATE_NAMES)
    step_text = ast.unparse(methods["step"])
    assert "group['step'] += " in step_text and "group['step'] = " in step_text
    assert "self.initialize_state(p" in step_text  # lazily, at the first step, like ours
    loads = ast.unparse(methods["load_state_dict"])
    assert "super().load_state_dict(state_dict)" in loads and "set_scaled_state" in loads


def _method(source: TESource, module: str, cls: str, name: str) -> ast.FunctionDef:
    node = next(
        (
            n
            for n in _class_node(source, module, cls).body
            if isinstance(n, ast.FunctionDef) and n.name == name
        ),
        None,
    )
    assert node is not None, f"{module}.{cls}.{name} not found"
    return node


def _positional(node: ast.FunctionDef) -> list[str]:
    return [a.arg for a in node.args.posonlyargs + node.args.args][1:]  # without self


def test_fp8_parameters_take_the_calls_master_weights_makes(te_source: TESource, te_double) -> None:
    """--fp8_weights with --master_weights optimizer (model_utils/precision/master_weights.py)
    calls TE duck-typed, outside the ``te.`` names collected above: FusedAdam's
    ``initialize_state(param, store_param_remainders)`` and
    ``set_scaled_state(param, state_name, unscaled_state)`` seed the masters; a QuantizedTensor
    parameter has ``quantize_(tensor)`` and ``dequantize(*, dtype=None)``, ``copy_`` into it
    quantises and ``detach`` keeps it quantized (the checkpoint's load path and the double's
    QuantizedTensor rely on both). The double's methods have the same parameters."""
    from transformer_engine.pytorch.quantized_tensor import QuantizedTensor as Double

    fused = "transformer_engine.pytorch.optimizers.fused_adam"
    init = _method(te_source, fused, "FusedAdam", "initialize_state")
    assert _positional(init) == ["param", "store_param_remainders"]
    seed = _method(te_source, fused, "FusedAdam", "set_scaled_state")
    assert _positional(seed) == ["param", "state_name", "unscaled_state"]

    module = "transformer_engine.pytorch.quantized_tensor"
    quantize = _method(te_source, module, "QuantizedTensor", "quantize_")
    dequantize = _method(te_source, module, "QuantizedTensor", "dequantize")
    assert (
        _positional(quantize)
        == ["tensor"]
        == list(inspect.signature(Double.quantize_).parameters)[1:]
    )
    assert [a.arg for a in dequantize.args.kwonlyargs] == ["dtype"]
    assert (
        inspect.signature(Double.dequantize).parameters["dtype"].kind
        is inspect.Parameter.KEYWORD_ONLY
    )
    dispatch = " ".join(
        ast.unparse(_method(te_source, module, "QuantizedTensor", "__torch_dispatch__")).split()
    )
    for rule in (
        "if isinstance(dst, QuantizedTensor): dst.quantize_(src)",
        "src = src.dequantize(dtype=dtype)",
        "if func == torch.ops.aten.detach.default: return args[0].detach()",
    ):
        assert rule in dispatch, rule
    for cls, where in (
        ("Float8Tensor", "float8_tensor"),
        ("MXFP8Tensor", "mxfp8_tensor"),
        ("Float8BlockwiseQTensor", "float8_blockwise_tensor"),
    ):
        for name in ("quantize_", "dequantize"):
            _method(te_source, f"transformer_engine.pytorch.tensor.{where}", cls, name)


#: The release's own cuDNN search, run in a fresh process after a stand-in for torch's cuDNN was
#: opened as torch from PyPI opens it (``dlopen``, RTLD_LOCAL), then TE's core library opened as
#: TE opens it; it prints what TE's search found, the cuDNN version the core library reaches
#: through its sub-library, and every cuDNN file mapped.
_LOADER_SCRIPT = """
import ctypes, functools, glob, os, platform, sys
ctypes.CDLL({torch_cudnn!r})
if {align}:
    from model_utils.config import te_loader
    te_loader.align_te_cudnn()
exec(compile({loader!r}, "transformer_engine/common/__init__.py", "exec"))
found, _ = _load_cuda_library_from_system("cudnn")
core = ctypes.CDLL({core!r}, mode=ctypes.RTLD_GLOBAL | os.RTLD_LAZY)
maps = open("/proc/self/maps").read().splitlines()
mapped = sorted({{line.split()[-1] for line in maps if "/libcudnn" in line}})
print(found, core.core_cudnn_version(), mapped)
"""


@pytest.mark.parametrize("layout", ["toolkit", "system"])
@pytest.mark.parametrize("align", [False, True], ids=["te-alone", "aligned"])
def test_te_opens_the_cudnn_torch_has_open(
    te_source: TESource, tmp_path, align: bool, layout: str
) -> None:
    """te_loader against each release's real loader (``_load_cuda_library_from_system`` and
    ``_get_sys_extension``, executed from the wheel's source) and real ``dlopen``, with torch's
    cuDNN family (9.19, pip's layout) and another one (9.14) on the library path: under
    CUDA_HOME (a toolkit), or only on the library path (the lent H100s: Debian's cuDNN in
    /lib/x86_64-linux-gnu, which TE finds last, by name).

    TE alone opens the other family's front library, and TE's core library (a stand-in that
    needs ``libcudnn_heuristic.so.9`` by soname) reaches 9.14 through the other family's
    sub-libraries. Aligned, TE's search finds torch's file and the core library torch's
    sub-libraries: one family in the process, 9.19 everywhere. Without the sub-libraries
    opened first (``CUDNN_HOME`` alone), the core library still reached 9.14: what the H100
    showed after the first fix."""
    from helpers.cudnn_standins import build_core, build_cudnn_family

    torch_lib = build_cudnn_family(
        tmp_path / "site-packages" / "nvidia" / "cudnn" / "lib", 91900, origin_runpath=True
    )
    cuda_home = tmp_path / "cuda"
    other_lib = cuda_home / "lib64" if layout == "toolkit" else tmp_path / "lib" / "x86_64"
    build_cudnn_family(other_lib, 91400, origin_runpath=False)
    (cuda_home / "include").mkdir(parents=True)
    core = build_core(tmp_path / "te" / "libtransformer_engine.so", torch_lib)
    common = te_source.modules["transformer_engine.common"]
    wanted = {"_get_sys_extension", "_load_cuda_library_from_system"}
    functions = [n for n in common.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert len(functions) == len(wanted), "TE's cuDNN loader changed: re-read te_loader"
    loader = ast.unparse(ast.Module(body=functions, type_ignores=[]))
    script = _LOADER_SCRIPT.format(
        root=str(ROOT),
        torch_cudnn=str(torch_lib / "libcudnn.so.9"),
        align=align,
        loader=loader,
        core=str(core),
    )
    env = {k: v for k, v in os.environ.items() if "CUDNN" not in k and k != "CUDA_PATH"}
    env |= {"CUDA_HOME": str(cuda_home), "LD_LIBRARY_PATH": str(other_lib)}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    family = ("libcudnn.so.9", "libcudnn_graph.so.9", "libcudnn_heuristic.so.9")
    if align:
        expected = (91900, sorted(str(torch_lib / name) for name in family))
    else:
        other = [str(other_lib / name) for name in family]
        expected = (91400, sorted([str(torch_lib / "libcudnn.so.9"), *other]))
    assert result.stdout.strip() == f"True {expected[0]} {expected[1]}"


# ------------------------------------------------------------------------------------------
# --fp8_numerics on the fused layers: TE's debug tools (transformer_engine/debug).
# ------------------------------------------------------------------------------------------


def module_calls(te_source: TESource, module: str) -> list[ast.Call]:
    return [n for n in ast.walk(te_source.modules[module]) if isinstance(n, ast.Call)]


def te_debug_stats(te_source: TESource) -> tuple[set[str], set[str]]:
    """What TE's LogTensorStats and LogFp8TensorStats offer: the first, nvdlfw-inspect's base
    stats (its ``_get_supported_stats_list``) and the set TE's adds; the second, the
    ``supported_stats`` of its check plus ``overflows%``, which it allows for delayed scaling."""
    import importlib.util

    def function(module: str, cls: str, name: str) -> ast.FunctionDef:
        found = te_source.resolve(f"transformer_engine.debug.features.{module}", cls)
        return class_member(found[1], name, found[0])[1]

    def strings(node: ast.AST) -> set[str]:
        return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant)} - {None}

    inspect_dir = Path(importlib.util.find_spec("nvdlfw_inspect").origin).parent
    base = ast.parse((inspect_dir / "debug_features" / "log_tensor_stats.py").read_text())
    own = function("log_tensor_stats", "LogTensorStats", "_get_supported_stats_list")
    tensor = {
        e.value
        for tree in (base, own)
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef) and n.name == "_get_supported_stats_list"
        for s in ast.walk(n)
        if isinstance(s, ast.Set)
        for e in s.elts
    }
    check = function("log_fp8_tensor_stats", "LogFp8TensorStats", "check_if_stat_is_supported")
    fp8 = next(
        strings(n.value)
        for n in ast.walk(check)
        if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "supported_stats"
    )
    if "== 'overflows%'" in ast.unparse(check):
        fp8.add("overflows%")
    return tensor, fp8


def test_the_fp8_numerics_config_asks_te_debug_tools_for_what_they_offer(
    te_source: TESource,
) -> None:
    """The features and stats of numerics.te_debug_config exist in TE's debug features, each
    registered in the transformer_engine namespace the config names."""
    from model_utils.precision import numerics

    config = numerics.te_debug_config(freq=10, delayed=True, kept=(0,))["fp8_numerics"]
    tensor_stats, fp8_stats = te_debug_stats(te_source)
    offered = {"LogTensorStats": tensor_stats, "LogFp8TensorStats": fp8_stats}
    for feature, settings in config["transformer_engine"].items():
        module = f"transformer_engine.debug.features.{feature_module(feature)}"
        cls = te_source.resolve(module, feature)
        assert cls, feature
        decorators = [ast.unparse(d) for d in cls[1].decorator_list]
        assert "Registry.register_feature(namespace='transformer_engine')" in decorators
        assert set(settings["stats"]) <= offered[feature], (feature, settings["stats"])
        assert set(settings["tensors"]) == set(numerics.TE_TENSORS)


def feature_module(feature: str) -> str:
    """LogFp8TensorStats -> log_fp8_tensor_stats."""
    return "log" + "".join(f"_{c.lower()}" if c.isupper() else c for c in feature[3:])


def test_te_names_its_statistics_and_gemms_as_the_figures_read_them(te_source: TESource) -> None:
    """numerics.te_figures parses ``<layer>_<tensor>_<stat>`` (TE's stats_buffer logs that),
    over TE's tensor labels, with the fused MLP's GEMMs named ``<name>.fc1``/``<name>.fc2``."""
    from model_utils.precision import numerics

    logged = [
        ast.unparse(call.args[0])
        for call in module_calls(te_source, "transformer_engine.debug.features.utils.stats_buffer")
        if ast.unparse(call.func) == "MetricLogger.log_scalar"
    ]
    assert logged and all(
        name.startswith("f'{self.layer_name}_{self.tensor_name}_{") for name in logged
    ), logged
    mlp = te_source.resolve("transformer_engine.pytorch", "LayerNormMLP")
    debug = class_member(mlp[1], "_get_debug_quantizers", mlp[0])
    source = ast.unparse(debug[1])
    assert "f'{self.name}.{prefix}'" in source
    assert "make_debug('fc1', 0) + make_debug('fc2', 6)" in source
    labels = next(n for n in ast.walk(debug[1]) if isinstance(n, ast.List))
    assert set(numerics.TE_TENSORS) <= {e.value for e in labels.elts}


def test_the_double_debug_tools_offer_what_te_offers(pinned_te_source: TESource, te_double):
    """The double's features name TE's stats (it computes the ones the recipe reads), and its
    refusal of a TE module built before the tools started is TE's."""
    import inspect as inspect_module

    from transformer_engine.debug.pytorch import debug_state

    double_features = Path(debug_state.__file__).parents[1] / "features" / "log_stats.py"
    double = ast.parse(double_features.read_text())
    values = {
        t.id: ast.literal_eval(n.value)
        for n in double.body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    tensor_stats, fp8_stats = te_debug_stats(pinned_te_source)
    assert values["TE_TENSOR_STATS"] == tensor_stats
    assert values["TE_FP8_STATS"] == fp8_stats
    refusal = "nv_dlfw_inspect module should be initialized before"
    te_state = ast.unparse(pinned_te_source.modules["transformer_engine.debug.pytorch.debug_state"])
    assert refusal in te_state and refusal in inspect_module.getsource(debug_state)


def test_te_fused_mlp_refuses_a_backward_override_and_so_does_the_double(
    pinned_te_source: TESource, te_double
) -> None:
    """TE's LayerNormMLP, inside TransformerLayer (--model_impl te), asserts a recipe's
    backward_override is None under FP8, and the double asserts the same; so the plan refuses
    --fp8_backward on te in one line (test_arguments) and te_linear's separate linears take it."""
    message = "is not implemented in LayerNormMLP"
    real = pinned_te_source.modules["transformer_engine.pytorch.module.layernorm_mlp"]
    assert message in ast.unparse(real)
    transformer = pinned_te_source.modules["transformer_engine.pytorch.transformer"]
    assert "self.layernorm_mlp = LayerNormMLP(" in ast.unparse(transformer)
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe

    layer = te.TransformerLayer(
        hidden_size=16,
        ffn_hidden_size=16,
        num_attention_heads=2,
        **dict(fuse_qkv_params=True, qkv_weight_interleaved=False, bias=False),
        **dict(activation="swiglu", normalization="RMSNorm", attn_input_format="bshd"),
        device="cpu",
    )
    mlp = layer.layernorm_mlp  # TE's attribute name (transformer.py)
    override = recipe.Float8CurrentScaling(backward_override="high_precision")
    with pytest.raises(AssertionError, match=message), te.autocast(enabled=True, recipe=override):
        mlp(torch.randn(8, 16))
    with te.autocast(enabled=True, recipe=recipe.Float8CurrentScaling()):
        assert mlp(torch.randn(8, 16)).shape == (8, 16)


def test_the_double_accepts_the_backward_overrides_te_accepts(
    pinned_te_source: TESource, te_double
):
    """--fp8_backward's choices other than fp8 are TE's ``_BACKWARD_OVERRIDES`` (None is TE's
    FP8 backward), and the double checks a recipe against the same tuple."""
    from transformer_engine.common import recipe as double_recipe

    tree = pinned_te_source.modules["transformer_engine.common.recipe"]
    (real,) = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "_BACKWARD_OVERRIDES"
    ]
    assert double_recipe._BACKWARD_OVERRIDES == real
    (backward,) = [f for f in dataclasses.fields(PrecisionConfig) if f.name == "fp8_backward"]
    assert set(spec_of(backward).choices) - {"fp8"} == set(real) - {None}


def test_attention_under_current_scaling_keeps_the_delayed_state_the_double_keeps(
    te_source: TESource, te_double
) -> None:
    """Under Float8CurrentScaling with fp8_dpa, TE's DotProductAttention quantizes S and dP with
    a delayed-scaling recipe of its own (``NVTE_DPA_FP8DS_*``: history 1, most_recent), whose
    state has one GEMM's slots after the current-scaling quantizers of two. So a checkpoint of
    a current-scaling run holds delayed state for attention, and te_state restores it with TE's
    [current, delayed] pair; the double keeps the same layout."""
    text = _source_text(
        te_source,
        "transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention",
    )
    for needle in (
        "os.getenv('NVTE_DPA_FP8DS_AMAX_ALGO', 'most_recent')",
        "int(os.getenv('NVTE_DPA_FP8DS_AMAX_HISTLEN', '1'))",
        "fp8_recipes = [fp8_recipe, fp8_recipe_dpa]",
        "num_gemms = [2, 1] if len(recipe) == 2 else [3]",
        "primary_idx = -1 if len(recipe) == 2 else 0",
    ):
        assert needle in text, needle
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe

    attention = te._DotProductAttention()
    attention._init_fp8_metadata(recipe.Float8CurrentScaling(fp8_dpa=True))
    own = attention.fp8_meta["recipe"]
    assert (own.delayed(), own.amax_history_len, own.amax_compute_algo) == (True, 1, "most_recent")
    assert attention.fp8_meta["scaling_fwd"].scale.numel() == 3
    assert attention.fp8_meta["scaling_bwd"].scale.numel() == 2
    attention.init_fp8_meta_tensors([recipe.Float8CurrentScaling(), own])
    assert attention.fp8_meta["scaling_fwd"].scale.numel() == 3  # kept, as TE keeps it
