"""TEST DOUBLE of ``transformer_engine.pytorch`` (TE 2.20.2 API subset), pure PyTorch on CPU.

What it models, so tests exercise real behaviour rather than a stub:

* ``TransformerLayer`` / ``Linear`` with TE's parameter names, ``_extra_state`` entries,
  ``reset_parameters(defer_init)``, meta-device construction, TE's dtype rule (inputs must
  match parameter dtype outside ``torch.autocast``; inside it a module computes in autocast's
  dtype, which torch's autocast does not reach into) and TE's FP8 GEMM shape assertion.
  The math is ``tests/te_double/reference.py``.
* FP8 emulation inside ``autocast``: GEMM operands are rounded through torch's float8 dtypes
  (E4M3 forward; E5M2 gradients with ``Format.HYBRID``) with per-tensor current scaling,
  1x128 blocks (``Float8BlockScaling``), 32-element power-of-two blocks (``MXFP8BlockScaling``)
  or delayed scaling from an amax history, saved in ``_extra_state``. The weight is rounded
  from its activation-dtype copy: under ``torch.autocast`` with fp32 parameters TE quantizes
  the fp32 parameter itself, one rounding where the double makes two. Like TE's
  ``FP8GlobalStateManager``, every module that ran delayed scaling is registered once in a
  process-wide buffer per (recipe, group); forward amaxes are all-reduced (MAX) over the
  ``amax_reduction_group`` and the scales updated when the outermost ``autocast`` exits with
  grad enabled, backward amaxes when the backward of the region's first FP8 module ends, and
  the recompute of ``checkpoint`` runs inside its own ``autocast``, whose exit updates the
  forward state once more.
* FP8 attention (a recipe's ``fp8_dpa``): Q, K, V, the softmax output and the attention output
  are rounded through E4M3 and their gradients through E5M2 with the attention module's own
  delayed-scaling state (TE's ``META_*`` slots); where TE would find no backend (SM < 9.0;
  on SM 9.x anything but delayed scaling or head_dim 128) it raises TE's ValueError.
* ``is_first_microbatch`` caches the quantized weights; ``checkpoint`` and a
  ``layernorm_mlp.checkpoint`` set to True recompute in backward, replaying the forward's FP8
  state; ``quantized_model_init`` rounds weights to FP8 at init (values
  only: parameters stay ordinary tensors).
* ``optimizers.FusedAdam``: TE's signature and its constructor's failure without CUDA (TE's is
  GPU-only; the recipe builds it only for a CUDA device).
* ``quantized_tensor.QuantizedTensor``: the API of TE's FP8 parameters (``quantize_``,
  ``dequantize``, ``copy_`` quantises), for unit tests of the recipe's FP8-weight training.

The emulated device is an H100 (SM 9.0, CUDA 12.9); set ``TE_DOUBLE_SM=10.0`` to emulate a
Blackwell (MXFP8) or ``8.0`` for an A100 (no FP8).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import pickle
import warnings
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from te_double import reference
from torch import nn

from transformer_engine.common import recipe as _recipe
from transformer_engine.debug.pytorch.debug_state import TEDebugState, inspect_gemm_operand
from transformer_engine.pytorch import _extra_state, distributed, optimizers
from transformer_engine.pytorch.distributed import checkpoint

__all__ = [
    "Linear",
    "TransformerLayer",
    "autocast",
    "checkpoint",
    "distributed",
    "fp8_autocast",
    "fp8_model_init",
    "get_cudnn_version",
    "get_device_compute_capability",
    "is_fp8_available",
    "is_fp8_block_scaling_available",
    "is_mxfp8_available",
    "make_graphed_callables",
    "optimizers",
    "quantized_model_init",
]

_FP8_DTYPES = {"E4M3": torch.float8_e4m3fn, "E5M2": torch.float8_e5m2}
_BLOCK = {"block": 128, "mxfp8": 32}


# ---------------------------------------------------------------------------------------------
# Emulated device and availability checks.
# ---------------------------------------------------------------------------------------------


def get_device_compute_capability() -> tuple[int, int]:
    """The emulated GPU's SM version (``TE_DOUBLE_SM``, default 9.0)."""
    major, minor = os.environ.get("TE_DOUBLE_SM", "9.0").split(".")
    return int(major), int(minor)


def get_cudnn_version() -> tuple[int, int, int]:
    """The emulated runtime cuDNN (``TE_DOUBLE_CUDNN``, default 9.19.0): TE's own answer, from
    the libcudnn TE loaded, which need not be the one torch was built with."""
    major, minor, patch = os.environ.get("TE_DOUBLE_CUDNN", "9.19.0").split(".")
    return int(major), int(minor), int(patch)


def _answer(ok: bool, reason: str, return_reason: bool) -> bool | tuple[bool, str]:
    return (ok, "" if ok else reason) if return_reason else ok


def is_fp8_available(return_reason: bool = False) -> bool | tuple[bool, str]:
    ok = get_device_compute_capability() >= (8, 9)
    reason = "Device compute capability 8.9 or higher required for FP8 execution."
    return _answer(ok, reason, return_reason)


def is_mxfp8_available(return_reason: bool = False) -> bool | tuple[bool, str]:
    ok = (10, 0) <= get_device_compute_capability() < (12, 0)
    reason = "Device compute capability 10.0 or higher required for MXFP8 execution."
    return _answer(ok, reason, return_reason)


def is_fp8_block_scaling_available(return_reason: bool = False) -> bool | tuple[bool, str]:
    ok = get_device_compute_capability() >= (9, 0)
    reason = "FP8 block scaled GEMM requires compute capability 9.0 or higher and CUDA >= 12.9."
    return _answer(ok, reason, return_reason)


def _check_recipe_support(fp8_recipe: Any) -> None:
    kind = _recipe.recipe_kind(fp8_recipe)
    check = {
        "mxfp8": is_mxfp8_available,
        "block": is_fp8_block_scaling_available,
    }.get(kind, is_fp8_available)
    ok, reason = check(return_reason=True)
    if not ok:
        raise RuntimeError(reason)


# ---------------------------------------------------------------------------------------------
# Global FP8 state (what TE's FP8GlobalStateManager tracks).
# ---------------------------------------------------------------------------------------------


class _State:
    def __init__(self) -> None:
        self.enabled = False
        self.recipe: Any = None
        self.group: Any = None
        self.recompute = False
        #: TE's ``autocast_depth`` and ``is_first_fp8_module``: set on entering the outermost
        #: autocast, taken by the first FP8 module whose forward records autograd.
        self.depth = 0
        self.first_module = False
        #: TE's global amax buffers: per (recipe, group) key, the modules registered by their
        #: first delayed-scaling forward. Weak references: TE holds its modules for the
        #: process's life; a test process builds many models and drops them.
        self.buffers: dict[str, list[weakref.ref[_TEModule]]] = {}
        self.buffer_args: dict[str, tuple[Any, Any]] = {}
        self.registered: weakref.WeakSet[_TEModule] = weakref.WeakSet()
        self.model_init_fp8 = False
        self.model_init_recipe: Any = None

    def snapshot(self) -> tuple:
        """TE's ``get_autocast_state``: what an autocast saves on entry and restores on exit."""
        return (self.enabled, self.recipe, self.group, self.first_module)

    def restore(self, snapshot: tuple) -> None:
        self.enabled, self.recipe, self.group, self.first_module = snapshot

    def take_first_module(self) -> bool:
        """TE's ``is_first_fp8_module``: True once per outermost autocast."""
        first, self.first_module = self.first_module, False
        return first


_STATE = _State()


def get_default_recipe() -> _recipe.Recipe:
    """TE's recipe for an autocast given none (quantization.py), which, like TE's, refuses to
    be built while torch.compile traces: pass an explicit recipe there."""
    assert not torch.compiler.is_compiling(), (
        "Creating Recipe objects inside compiled regions is not supported because their "
        "construction is not traceable. Pass an explicit recipe to te.autocast() instead."
    )
    sm = get_device_compute_capability()
    if (10, 0) <= sm < (12, 0):
        return _recipe.MXFP8BlockScaling()
    return _recipe.Float8CurrentScaling() if sm >= (12, 0) else _recipe.DelayedScaling()


class autocast:
    """Context manager enabling (emulated) FP8 GEMMs in TE modules run inside it."""

    def __init__(
        self,
        enabled: bool = True,
        calibrating: bool = False,
        recipe: _recipe.Recipe | None = None,
        amax_reduction_group: Any = None,
        _graph: bool = False,
    ) -> None:
        self._enabled = enabled
        self._recipe = recipe
        self._group = amax_reduction_group
        self._graph = _graph
        self._saved: tuple | None = None

    def __enter__(self) -> autocast:
        if self._saved is not None:
            raise RuntimeError("autocast context manager cannot be entered more than once")
        fp8_recipe = self._recipe if self._recipe is not None else get_default_recipe()
        if self._enabled:
            _check_recipe_support(fp8_recipe)
        self._saved = _STATE.snapshot()
        _STATE.enabled, _STATE.recipe, _STATE.group = self._enabled, fp8_recipe, self._group
        if _STATE.depth == 0:
            _STATE.first_module = True
        _STATE.depth += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        """TE's ``autocast_exit``: only the outermost exit, with grad enabled, updates the
        forward scaling state (an inference forward's amaxes wait in row 0 for the next one)."""
        try:
            _STATE.restore(self._saved)
            _STATE.depth -= 1
            if self._enabled and _STATE.depth == 0 and not self._graph and torch.is_grad_enabled():
                _reduce_and_update(forward=True)
        finally:
            self._saved = None


def make_graphed_callables(
    modules: Any,
    sample_args: Any,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    sample_kwargs: Any = None,
    fp8_enabled: Any = None,
    fp8_calibrating: bool | None = None,
    fp8_recipe: _recipe.Recipe | None = None,
    fp8_group: Any = None,
    fp8_weight_caching: bool | None = None,
    enabled: Any = None,
    calibrating: bool | None = None,
    recipe: _recipe.Recipe | None = None,
    amax_reduction_group: Any = None,
    cache_quantized_params: bool | None = None,
    _order: Any = None,
    _num_layers_per_chunk: Any = None,
    pool: Any = None,
    retain_graph_in_backward: bool = False,
    _reuse_graph_input_output_buffers: bool = False,
    clone_param_grads_on_return: bool = True,
    pre_warmup_hook: Callable | None = None,
    post_warmup_hook: Callable | None = None,
    capture_time_hooks: Any = None,
) -> Any:
    """TE's CUDA-graph capture, its contract without the graphs (a CPU has none): TE's refusals
    (autocast's weight cache, hooks on a module, non-tensor sample args), then each module's
    ``forward`` replaced as TE replaces it. In the capture's training mode a call must bring
    every captured keyword (TE's TypeError), inputs of the captured shapes (TE copies them into
    its static buffers) and the FP8 state it was captured with (TE replays the captured
    kernels whatever the state; the double refuses a mismatch so a test sees it); the other
    keywords are dropped, as TE drops them. The forward then runs eagerly. No warm-up runs:
    TE restores what its warm-up touches (gradients, RNG, FP8 scaling state)."""
    single = not isinstance(modules, tuple)
    modules = (modules,) if single else modules
    sample_args = (sample_args,) if single else sample_args
    sample_kwargs = sample_kwargs or tuple({} for _ in modules)
    sample_kwargs = (sample_kwargs,) if isinstance(sample_kwargs, dict) else sample_kwargs
    flags = enabled if isinstance(enabled, tuple) else (bool(enabled),) * len(modules)
    device = sample_args[0][0].device.type
    if torch.is_autocast_enabled(device) and torch.is_autocast_cache_enabled():
        raise RuntimeError(
            "make_graphed_callables does not support the autocast caching. Please set "
            "`cache_enabled=False`."
        )
    for module, args, kwargs, fp8 in zip(modules, sample_args, sample_kwargs, flags, strict=True):
        hooks = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks)
        if any(hooks) or module._backward_pre_hooks:
            raise RuntimeError(
                "Modules must not have hooks registered at the time they are passed."
            )
        if not all(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values())):
            raise TypeError("sample_args for each callable must contain only Tensors.")
        module.forward = _graphed_forward(module, args, kwargs, fp8, module.training)
    return modules[0] if single else modules


def _graphed_forward(module: nn.Module, args: tuple, kwargs: dict, fp8: bool, training: bool):
    original = module.forward
    shapes = [tuple(a.shape) for a in (*args, *kwargs.values())]

    def replay(*user_args: Any, **user_kwargs: Any) -> Any:
        if module.training != training:
            return original(*user_args, **user_kwargs)  # TE: the eager forward
        for key in kwargs:
            if key not in user_kwargs:
                raise TypeError(
                    f"Graphed callable was initialized with kwarg {key} ,but it was not provided "
                    "in graph replay"
                )
        given = (*user_args, *(user_kwargs[key] for key in kwargs))
        if [tuple(a.shape) for a in given] != shapes:
            raise RuntimeError(f"graph replay with shapes {[a.shape for a in given]}, not {shapes}")
        if _STATE.enabled != fp8:
            raise RuntimeError(f"captured with FP8 {fp8}, replayed with FP8 {_STATE.enabled}")
        return original(*user_args, **{key: user_kwargs[key] for key in kwargs})

    return replay


def fp8_autocast(
    enabled: bool = True,
    calibrating: bool = False,
    fp8_recipe: _recipe.Recipe | None = None,
    fp8_group: Any = None,
    _graph: bool = False,
) -> autocast:
    warnings.warn("fp8_autocast is deprecated; use autocast", DeprecationWarning, stacklevel=2)
    return autocast(
        enabled=enabled,
        calibrating=calibrating,
        recipe=fp8_recipe,
        amax_reduction_group=fp8_group,
        _graph=_graph,
    )


@contextmanager
def quantized_model_init(
    enabled: bool = True,
    recipe: _recipe.Recipe | None = None,
    preserve_high_precision_init_val: bool = False,
):
    saved = (_STATE.model_init_fp8, _STATE.model_init_recipe)
    _STATE.model_init_fp8 = enabled
    _STATE.model_init_recipe = recipe if recipe is not None else get_default_recipe()
    try:
        yield
    finally:
        _STATE.model_init_fp8, _STATE.model_init_recipe = saved


@contextmanager
def fp8_model_init(
    enabled: bool = True,
    recipe: _recipe.Recipe | None = None,
    preserve_high_precision_init_val: bool = False,
):
    warnings.warn("fp8_model_init is deprecated", DeprecationWarning, stacklevel=2)
    with quantized_model_init(
        enabled=enabled,
        recipe=recipe,
        preserve_high_precision_init_val=preserve_high_precision_init_val,
    ):
        yield


# ---------------------------------------------------------------------------------------------
# FP8 emulation.
# ---------------------------------------------------------------------------------------------


#: The recipes whose casts the double's debug tools inspect, by TE's recipe names.
_DEBUG_RECIPES = {"delayed": "fp8_delayed_scaling", "tensor": "fp8_current_scaling"}


class _DebugCast(NamedTuple):
    """What the debug features read of a cast (TE hands them its Float8Tensor)."""

    values: torch.Tensor
    scale_inv: torch.Tensor
    dtype: torch.dtype


def _formats(fp8_recipe: Any) -> tuple[str, str]:
    fmt = fp8_recipe.fp8_format.name
    return ("E4M3", "E5M2") if fmt == "HYBRID" else (fmt, fmt)


def _round_fp8(x: torch.Tensor, fmt: str, scale: torch.Tensor) -> torch.Tensor:
    fp8_max = torch.finfo(_FP8_DTYPES[fmt]).max
    scaled = (x.float() * scale).clamp(-fp8_max, fp8_max)
    return (scaled.to(_FP8_DTYPES[fmt]).float() / scale).to(x.dtype)


def _current_scale(amax: torch.Tensor, fmt: str, power_of_two: bool) -> torch.Tensor:
    fp8_max = torch.finfo(_FP8_DTYPES[fmt]).max
    scale = torch.where(amax > 0, fp8_max / amax.clamp_min(1e-30), torch.ones_like(amax))
    return torch.exp2(torch.floor(torch.log2(scale))) if power_of_two else scale


def fake_quantize(x: torch.Tensor, fmt: str, kind: str, scale: torch.Tensor | None = None):
    """Round ``x`` through FP8 ``fmt``; returns ``(rounded, amax)``.

    ``kind``: ``tensor`` (current per-tensor scale), ``delayed`` (given ``scale``), ``block``
    (1x128 blocks along the last dim) or ``mxfp8`` (1x32 blocks, power-of-two scales).
    """
    amax = x.detach().abs().amax().float()
    if kind == "delayed":
        return _round_fp8(x, fmt, scale), amax
    if kind == "tensor":
        return _round_fp8(x, fmt, _current_scale(amax, fmt, power_of_two=False)), amax
    block = _BLOCK[kind]
    width = x.shape[-1]
    padded = F.pad(x, (0, -width % block))  # a partial last block is scaled on its own
    blocks = padded.reshape(*x.shape[:-1], padded.shape[-1] // block, block)
    block_amax = blocks.detach().abs().amax(-1, keepdim=True).float()
    scale = _current_scale(block_amax, fmt, power_of_two=True)
    rounded = _round_fp8(blocks, fmt, scale).reshape(padded.shape)[..., :width]
    return rounded, amax


def _assert_dim_for_fp8_exec(*tensors: torch.Tensor) -> None:
    """TE's rule: leading dims' product divisible by 8, last dim by 16."""
    for tensor in tensors:
        lead = tensor.numel() // tensor.shape[-1]
        if lead % 8 != 0 or tensor.shape[-1] % 16 != 0:
            raise ValueError(
                "FP8 execution requires the product of all dimensions except the last to be"
                " divisible by 8 and the last dimension to be divisible by 16, but got tensor"
                f" with dims={list(tensor.size())}"
            )


class _Fp8Gemm(torch.autograd.Function):
    """``y = q(x) @ q(w).T``; backward quantizes the incoming gradient (E5M2 under HYBRID).

    Under a recipe's ``backward_override`` the backward GEMMs run in high precision: on the
    forward's original operands (``high_precision``) or its FP8 ones dequantized
    (``dequantized``), the gradient unquantized (TE's ``backward_override`` modes).
    ``reduce_bwd`` marks the autocast region's first FP8 GEMM: its backward, the region's last,
    ends by updating the backward scaling state, as TE's modules do when they hold
    ``reduce_and_update_bwd_fp8_tensors``.
    """

    @staticmethod
    def forward(ctx, x, weight, weight_q, module, index, reduce_bwd):
        x_q = module._quantize(x, index, role="input")
        ctx.override = getattr(module.fp8_meta["recipe"], "backward_override", None)
        if ctx.override == "high_precision":
            ctx.save_for_backward(x, weight.to(x.dtype))
        else:
            ctx.save_for_backward(x_q, weight_q)
        ctx.module, ctx.index, ctx.weight_dtype = module, index, weight.dtype
        ctx.reduce_bwd = reduce_bwd
        return x_q @ weight_q.t()

    @staticmethod
    def backward(ctx, grad_out):
        x_q, weight_q = ctx.saved_tensors
        g_q = grad_out
        if ctx.override is None:
            g_q = ctx.module._quantize(grad_out, ctx.index, role="grad")
        grad_x = g_q @ weight_q
        grad_w = (g_q.t() @ x_q).to(ctx.weight_dtype)
        if ctx.reduce_bwd:
            _reduce_and_update(forward=False)
        return grad_x, grad_w, None, None, None, None


# ---------------------------------------------------------------------------------------------
# Modules.
# ---------------------------------------------------------------------------------------------


def _resolve_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        return torch.device("cpu")  # the double's "GPU" is the CPU
    return device


def _refuse_unsupported(func: Callable, values: dict[str, Any], supported: set[str]) -> None:
    """Raise for any argument the double does not model that differs from TE's default."""
    for name, param in inspect.signature(func).parameters.items():
        if name in supported or name == "self" or param.default is inspect.Parameter.empty:
            continue
        if values.get(name, param.default) != param.default:
            raise NotImplementedError(f"the TE test double does not model {name}={values[name]!r}")


class _TEModule(nn.Module):
    """Shared by the double's TE modules: init metadata, FP8 bookkeeping, extra state."""

    def __init__(self, num_gemms: int) -> None:
        super().__init__()
        self.param_init_meta: dict[str, Callable] = {}
        self.num_gemms = num_gemms
        self.primary_weights_in_fp8 = _STATE.model_init_fp8
        self._init_recipe = _STATE.model_init_recipe
        # TE's layout: fp8_meta["scaling_fwd"/"scaling_bwd"] hold the recipe state (for delayed
        # scaling ``scale`` [n] and ``amax_history`` [len, n]; n = 3 per GEMM forward, 2 backward).
        self.fp8_meta: dict[str, Any] = {"fp8_checkpoint": False, "fp8_group": None}
        self.fp8_meta_tensors_initialized = False
        self.fp8_initialized = False
        self._weight_cache: dict[int, torch.Tensor] = {}
        #: TE's debug name (``name=`` or set later, e.g. by nvdlfw-inspect's
        #: ``infer_and_assign_layer_names``); TE checks the debug tools at construction.
        self.name: str | None = None
        TEDebugState.initialize()

    def _register(self, name: str, tensor: torch.Tensor, init_fn: Callable) -> None:
        self.register_parameter(name, nn.Parameter(tensor))
        self.param_init_meta[name] = init_fn

    @torch.no_grad()
    def reset_parameters(self, defer_init: bool | None = False) -> None:
        if defer_init:
            return
        from torch.distributed.tensor import DTensor

        for name, param in self.named_parameters(recurse=False):
            original = param._local_tensor if isinstance(param, DTensor) else param
            local = original
            if local.device.type == "meta":
                local = torch.empty_like(original, device=_resolve_device("cuda"))
            self.param_init_meta[name](local)
            if self.primary_weights_in_fp8 and name.endswith("weight") and "norm" not in name:
                fmt = _formats(self._init_recipe)[0]
                local.copy_(fake_quantize(local, fmt, "tensor")[0])
            if local is original:
                continue
            if isinstance(param, DTensor):
                local = DTensor.from_local(
                    local,
                    device_mesh=param.device_mesh,
                    placements=param.placements,
                    shape=param.size(),
                    stride=param.stride(),
                )
            setattr(self, name, nn.Parameter(local))

    # -- FP8 state ---------------------------------------------------------------------------

    def init_fp8_meta_tensors(self, recipe: Any) -> None:
        """TE's allocation of the recipe state; keeps delayed-scaling tensors it already has
        (resizing the history to the recipe's length), as TE's ``set_meta_tensor`` does."""
        for key, per_gemm in (("scaling_fwd", 3), ("scaling_bwd", 2)):
            current = self.fp8_meta.get(key)
            if self.fp8_meta_tensors_initialized and recipe.delayed():
                if isinstance(current, _DelayedScalingState):
                    current.resize_history(recipe.amax_history_len)
                    continue
            n = self.fp8_meta["num_gemms"] * per_gemm
            self.fp8_meta[key] = _DelayedScalingState(recipe, n) if recipe.delayed() else object()
        self.fp8_meta_tensors_initialized = True

    def _init_fp8_metadata(self, recipe: Any) -> None:
        """TE's per-forward ``init_fp8_metadata`` under autocast."""
        meta = self.fp8_meta
        meta["fp8_checkpoint"] = True
        if self.fp8_initialized and meta.get("recipe") == recipe:
            return
        meta["recipe"] = recipe
        meta["num_gemms"] = self.num_gemms
        meta["fp8_group"] = _STATE.group
        self.init_fp8_meta_tensors(recipe)
        self.fp8_initialized = True

    def _prepare_forward(self) -> None:
        """TE's ``prepare_forward`` under autocast: metadata, then (delayed scaling, first time
        only) the module's entry in the global amax buffer of its recipe and group."""
        self._init_fp8_metadata(_STATE.recipe)
        if not _STATE.recompute:
            _add_to_global_buffer(self)

    def _quantize(self, x: torch.Tensor, index: int, role: str) -> torch.Tensor:
        """GEMM ``index``'s operand: its input or weight (forward) or incoming gradient; with
        TE's debug tools on, what they inspect of it (per-tensor scaling)."""
        direction, slot = ("bwd", 2 * index) if role == "grad" else ("fwd", 3 * index)
        slot += role == "weight"
        x_q = self._quantize_slot(x, direction, slot)
        if TEDebugState.debug_enabled and self.fp8_meta["recipe"].scaling in _DEBUG_RECIPES:
            self._inspect(x, x_q, index, role, direction, slot)
        return x_q

    def _inspect(self, x, x_q, index: int, role: str, direction: str, slot: int) -> None:
        """The operand and its cast to the features: TE names the fused MLP's two GEMMs
        ``<name>.fc1`` and ``<name>.fc2``, and the tensors activation, weight and gradient."""
        if self.name is None:
            self.name = f"Layer_{TEDebugState.get_layer_count()}"
        fp8_recipe = self.fp8_meta["recipe"]
        fmt = _formats(fp8_recipe)[direction == "bwd"]
        if fp8_recipe.scaling == "delayed":
            scale = self.fp8_meta[f"scaling_{direction}"].scale[slot]
        else:
            scale = _current_scale(x.detach().abs().amax().float(), fmt, power_of_two=False)
        layer = self.name + (f".fc{index + 1}" if isinstance(self, _LayerNormMLP) else "")
        tensor = {"input": "activation", "weight": "weight", "grad": "gradient"}[role]
        cast = _DebugCast(x_q, 1 / scale, _FP8_DTYPES[fmt])
        inspect_gemm_operand(layer, tensor, x, cast, _DEBUG_RECIPES[fp8_recipe.scaling])

    def _quantize_slot(self, x: torch.Tensor, direction: str, slot: int) -> torch.Tensor:
        """Round ``x`` through FP8 with the scaling of ``fp8_meta["scaling_<direction>"]``'s
        ``slot`` (TE's FP8FwdTensors / FP8BwdTensors index) under delayed scaling."""
        fp8_recipe = self.fp8_meta["recipe"]
        fwd_fmt, bwd_fmt = _formats(fp8_recipe)
        fmt = bwd_fmt if direction == "bwd" else fwd_fmt
        kind = fp8_recipe.scaling
        if kind != "delayed":
            return fake_quantize(x, fmt, kind)[0]
        state = self.fp8_meta[f"scaling_{direction}"]
        x_q, amax = fake_quantize(x, fmt, "delayed", state.scale[slot])
        if not _STATE.recompute:  # TE records this iteration's amax in history row 0
            state.amax_history[0, slot] = torch.maximum(state.amax_history[0, slot], amax)
        return x_q

    def _gemm(
        self, x: torch.Tensor, weight: torch.Tensor, index: int, is_first_microbatch: bool | None
    ) -> torch.Tensor:
        """``x @ weight.T`` under TE's dtype rule and, inside autocast, emulated FP8."""
        if not _STATE.enabled:
            return F.linear(x, weight)
        _assert_dim_for_fp8_exec(x, weight)
        self._prepare_forward()
        records_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        reduce_bwd = records_grad and not _STATE.recompute and _STATE.take_first_module()
        if is_first_microbatch is False and index in self._weight_cache:
            weight_q = self._weight_cache[index]
        else:
            weight_q = self._quantize(weight.detach(), index, role="weight")
            if is_first_microbatch is not None:
                self._weight_cache[index] = weight_q
        x2d = x.reshape(-1, x.shape[-1])
        out = _Fp8Gemm.apply(x2d, weight, weight_q, self, index, reduce_bwd)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    def get_extra_state(self) -> torch.Tensor:
        """TE 2.20.2's format: stateless recipes save nothing; delayed scaling pickles its
        scales and histories with the recipe object (which TE >= 2.18 refuses to unpickle)."""
        meta = self.fp8_meta
        if not meta["fp8_checkpoint"] or "recipe" not in meta or not meta["recipe"].delayed():
            return torch.empty(0, dtype=torch.uint8)
        fwd, bwd = meta["scaling_fwd"], meta["scaling_bwd"]
        state = {
            "recipe": meta["recipe"],
            "scale_fwd": fwd.scale.clone(),
            "amax_history_fwd": fwd.amax_history.clone(),
            "scale_bwd": bwd.scale.clone(),
            "amax_history_bwd": bwd.amax_history.clone(),
            "extra_fp8_variables": {
                k: v for k, v in meta.items() if isinstance(v, (bool, int, float, str, tuple, list))
            },
        }
        return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)

    def set_extra_state(self, state: torch.Tensor | None) -> None:
        if state is None or state.numel() == 0:
            return
        payload = state.detach().cpu().numpy().tobytes()
        if not _extra_state.should_load_extra_state_pickle(payload, type(self).__name__):
            return
        loaded = pickle.loads(payload)
        self.fp8_meta.update(loaded["extra_fp8_variables"])
        self.fp8_meta["recipe"] = loaded["recipe"]
        self.init_fp8_meta_tensors(loaded["recipe"])
        for direction in ("fwd", "bwd"):
            target = self.fp8_meta[f"scaling_{direction}"]
            target.scale.copy_(loaded[f"scale_{direction}"])
            target.amax_history.copy_(loaded[f"amax_history_{direction}"])


class _DelayedScalingState:
    """TE's ``DelayedScalingRecipeState``: ``scale`` and ``amax_history`` (float32). Row 0 of
    the history collects the current iteration's amaxes until :func:`_reduce_and_update` reduces
    and rolls it: at the autocast exit for the forward state, at the end of backward for the
    backward state."""

    def __init__(self, recipe: Any, num_quantizers: int) -> None:
        self.scale = torch.ones(num_quantizers)
        self.amax_history = torch.zeros(recipe.amax_history_len, num_quantizers)

    def resize_history(self, length: int) -> None:
        rows = self.amax_history.shape[0]
        if length < rows:
            self.amax_history = self.amax_history[:length].clone()
        elif length > rows:
            self.amax_history = F.pad(self.amax_history, (0, 0, 0, length - rows))


def _buffer_key(recipe: Any, group: Any) -> str:
    """TE's ``get_unique_autocast_key``: the recipe's repr and the group's identity."""
    return f"recipe={recipe},group={id(group) if group is not None else None}"


def _add_to_global_buffer(module: _TEModule) -> None:
    """TE's ``add_fp8_tensors_to_global_buffer``: once per module, delayed scaling only."""
    meta = module.fp8_meta
    if module in _STATE.registered or not meta["recipe"].delayed():
        return
    key = _buffer_key(meta["recipe"], meta["fp8_group"])
    _STATE.buffers.setdefault(key, []).append(weakref.ref(module))
    _STATE.buffer_args[key] = (meta["recipe"], meta["fp8_group"])
    _STATE.registered.add(module)


def _reduce_and_update(forward: bool) -> None:
    """TE's ``reduce_and_update_fp8_tensors``: for each buffer, concatenate row 0 of every
    registered module's forward (or backward) histories, all-reduce it (MAX) over the buffer's
    group, then per module update the scales and roll the history."""
    direction = "fwd" if forward else "bwd"
    for key, refs in _STATE.buffers.items():
        refs[:] = [ref for ref in refs if ref() is not None]
        states = [ref().fp8_meta.get(f"scaling_{direction}") for ref in refs]
        states = [state for state in states if isinstance(state, _DelayedScalingState)]
        if not states:
            continue
        fp8_recipe, group = _STATE.buffer_args[key]
        flat = torch.cat([state.amax_history[0] for state in states])
        if (
            fp8_recipe.reduce_amax
            and torch.distributed.is_available()
            and torch.distributed.is_initialized()
            and torch.distributed.get_world_size(group=group) > 1
        ):
            torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.MAX, group=group)
        fmt = _formats(fp8_recipe)[0 if forward else 1]
        offset = 0
        for state in states:
            size = state.amax_history.shape[1]
            state.amax_history[0] = flat[offset : offset + size]
            offset += size
            _amax_and_scale_update(state, fp8_recipe, fmt)


def _amax_and_scale_update(state: _DelayedScalingState, fp8_recipe: Any, fmt: str) -> None:
    """TE's ``_default_get_amax_and_update_history`` and ``_default_sf_compute``."""
    history = state.amax_history
    if fp8_recipe.amax_compute_algo == "max":
        amax = history.amax(0)
    else:
        amax = history[0].clone()
    history.copy_(torch.roll(history, -1, dims=0))  # row 0 starts the next iteration
    history[0].zero_()
    fp8_max = torch.finfo(_FP8_DTYPES[fmt]).max
    scale = state.scale
    new = (fp8_max / amax) / 2**fp8_recipe.margin
    new = torch.where(amax > 0, new, scale)
    new = torch.where(torch.isfinite(amax), new, scale)
    new = torch.where(torch.isinf(new), torch.full_like(new, torch.finfo(torch.float32).max), new)
    scale.copy_(new)


#: The ``torch.autocast`` dtype the outermost TE module of a forward was entered with, while
#: its forward runs (:func:`_te_kernels`); None outside.
_ENTERED_AUTOCAST: list[torch.dtype | None] = [None]


def _te_kernels(forward: Callable) -> Callable:
    """TE's kernels are its own ops, which ``torch.autocast`` does not dispatch: a TE module
    reads autocast's dtype on entry (its activation dtype) and computes everything in it, its
    FP8 GEMMs accumulating in fp32. The double computes with torch ops, so once that dtype is
    read it turns autocast off inside the module (nested TE modules read the entered dtype)."""

    @functools.wraps(forward)
    def run(self: nn.Module, inp: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        device = inp.device.type
        if not torch.is_autocast_enabled(device):
            return forward(self, inp, *args, **kwargs)
        outer, _ENTERED_AUTOCAST[0] = _ENTERED_AUTOCAST[0], torch.get_autocast_dtype(device)
        try:
            with torch.autocast(device, enabled=False):
                return forward(self, inp, *args, **kwargs)
        finally:
            _ENTERED_AUTOCAST[0] = outer

    return run


def _activation_dtype(x: torch.Tensor, params: list[torch.Tensor]) -> torch.dtype:
    """TE's rule: cast to the ``torch.autocast`` dtype, else all dtypes must already agree."""
    if _ENTERED_AUTOCAST[0] is not None:
        return _ENTERED_AUTOCAST[0]
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    for param in params:
        if param.dtype != x.dtype:
            raise TypeError(
                "Data types for parameters must match when outside of autocasted region. "
                f"Found input dtype: {x.dtype} and parameter dtype: {param.dtype}"
            )
    return x.dtype


class Linear(_TEModule):
    """``y = x @ weight.T (+ bias)``, parameters ``weight`` (and ``bias``)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group: Any = None,
        tp_size: int = 1,
        get_rng_state_tracker: Callable | None = None,
        rng_tracker_name: str | None = None,
        init_method: Callable | None = None,
        bias: bool = True,
        return_bias: bool = False,
        params_dtype: torch.dtype | None = None,
        parallel_mode: str | None = None,
        parameters_split: tuple[str, ...] | dict[str, int] | None = None,
        device: torch.device | str = "cuda",
        ub_overlap_ag: bool = False,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        ub_name: str | None = None,
        delay_wgrad_compute: bool = False,
        symmetric_ar_type: str | None = None,
        save_original_input: bool = False,
        name: str | None = None,
    ) -> None:
        _refuse_unsupported(
            Linear.__init__,
            locals(),
            {"in_features", "out_features", "init_method", "bias", "params_dtype", "device", "name"}
            | {"get_rng_state_tracker", "rng_tracker_name", "ub_name"},
        )
        super().__init__(num_gemms=1)
        self.name = name
        dtype = params_dtype or torch.get_default_dtype()
        dev = _resolve_device(device)
        init = init_method or (lambda t: nn.init.normal_(t, 0.0, 0.023))
        self.in_features, self.out_features = in_features, out_features
        self._register(
            "weight", torch.empty(out_features, in_features, dtype=dtype, device=dev), init
        )
        if bias:
            self._register(
                "bias", torch.empty(out_features, dtype=dtype, device=dev), nn.init.zeros_
            )
        else:
            self.bias = None
        self.reset_parameters(defer_init=dev.type == "meta")

    @_te_kernels
    def forward(
        self,
        inp: torch.Tensor,
        is_first_microbatch: bool | None = None,
        fp8_output: bool | None = False,
        fp8_grad: bool | None = False,
    ) -> torch.Tensor:
        params = [self.weight] + ([self.bias] if self.bias is not None else [])
        dtype = _activation_dtype(inp, params)
        out = self._gemm(inp.to(dtype), self.weight.to(dtype), 0, is_first_microbatch)
        return out if self.bias is None else out + self.bias.to(dtype)


class _LayerNormLinear(_TEModule):
    """RMSNorm + fused QKV projection: ``layer_norm_weight`` and one ``weight``."""

    def __init__(self, hidden: int, out: int, dtype, device, init: Callable) -> None:
        super().__init__(num_gemms=1)
        self._register(
            "layer_norm_weight", torch.empty(hidden, dtype=dtype, device=device), nn.init.ones_
        )
        self._register("weight", torch.empty(out, hidden, dtype=dtype, device=device), init)
        self.reset_parameters(defer_init=device.type == "meta")


#: FP8 attention's scaling slots, TE's ``cpp_extensions/fused_attn.py``: ``META_QKV`` =
#: GEMM1_OUTPUT, ``META_O`` = GEMM2_INPUT, ``META_S`` = GEMM3_OUTPUT (forward);
#: ``META_DQKV`` = GRAD_OUTPUT1, ``META_DO`` = GRAD_INPUT2, ``META_DP`` = GRAD_INPUT3 (backward).
_DPA_SLOTS = {"qkv": (2, 0), "o": (3, 3), "s": (8, 5)}


class _Fp8Cast(torch.autograd.Function):
    """Forward: the tensor rounded through FP8 (E4M3); backward: its gradient rounded (E5M2
    under HYBRID), as cuDNN's FP8 attention keeps Q, K, V, S, O and dQKV, dO, dP in FP8."""

    @staticmethod
    def forward(ctx, x, module, role):
        ctx.module, ctx.role = module, role
        return module._quantize_slot(x, "fwd", _DPA_SLOTS[role][0])

    @staticmethod
    def backward(ctx, grad):
        return ctx.module._quantize_slot(grad, "bwd", _DPA_SLOTS[ctx.role][1]), None, None


class _DotProductAttention(_TEModule):
    """No parameters. Like TE's ``DotProductAttention`` (``prepare_forward(num_gemms=3)``), it
    allocates the recipe state whenever autocast is on, so a delayed-scaling ``_extra_state``
    is saved whether or not ``fp8_dpa`` is set; with ``fp8_dpa`` the attention's operands are
    rounded through FP8 with that state (the emulation of cuDNN's FP8 fused attention)."""

    #: The current-scaling quantizers of TE's [current, delayed] splice come first (QKV, O: two
    #: GEMMs forward, three slots each; dO, dQKV backward, two each), S and dP's delayed ones after.
    _SPLICE_OFFSET = {"fwd": 6, "bwd": 4}

    def __init__(self) -> None:
        super().__init__(num_gemms=3)
        self._spliced_with: Any = None  # the current-scaling recipe of a splice

    def _init_fp8_metadata(self, recipe: Any) -> None:
        """TE's DPA ``init_fp8_metadata``: under current scaling with ``fp8_dpa`` (and
        ``NVTE_DPA_FP8_RECIPE`` unset) QKV, O, dO and dQKV use the run's recipe, S and dP a
        delayed-scaling recipe of the module's own (NVTE_DPA_FP8DS_* knobs; ``fp8_meta["recipe"]``)
        whose state has one GEMM's slots."""
        if not (recipe.float8_current_scaling() and recipe.fp8_dpa):
            super()._init_fp8_metadata(recipe)
            return
        own = _recipe.DelayedScaling(
            fp8_format=recipe.fp8_format,
            amax_history_len=int(os.getenv("NVTE_DPA_FP8DS_AMAX_HISTLEN", "1")),
            amax_compute_algo=os.getenv("NVTE_DPA_FP8DS_AMAX_ALGO", "most_recent"),
            fp8_dpa=recipe.fp8_dpa,
            fp8_mha=recipe.fp8_mha,
            reduce_amax=os.getenv("NVTE_DPA_FP8DS_REDUCE_AMAX", "1") == "1",
        )
        meta = self.fp8_meta
        meta["fp8_checkpoint"] = True
        if self.fp8_initialized and meta.get("recipe") == own:
            return
        meta["recipe"], meta["num_gemms"], meta["fp8_group"] = own, self.num_gemms, _STATE.group
        self.init_fp8_meta_tensors([recipe, own])
        self.fp8_initialized = True

    def init_fp8_meta_tensors(self, recipe: Any) -> None:
        """TE's DPA ``set_meta_tensor``: a recipe's state has three GEMMs' slots, and of TE's
        [current, delayed] pair the delayed one's state one GEMM's, whatever ``num_gemms`` says."""
        spliced_with, own = recipe if isinstance(recipe, list) else (None, recipe)
        state = self.fp8_meta.get("scaling_fwd")
        if not (self.fp8_meta_tensors_initialized and isinstance(state, _DelayedScalingState)):
            self._spliced_with = spliced_with  # TE makes new quantizers only with a new state
        num_gemms = self.fp8_meta.get("num_gemms")
        self.fp8_meta["num_gemms"] = 3 if spliced_with is None else 1
        super().init_fp8_meta_tensors(own)
        self.fp8_meta["num_gemms"] = num_gemms

    def _quantize_slot(self, x: torch.Tensor, direction: str, slot: int) -> torch.Tensor:
        if self._spliced_with is None:
            return super()._quantize_slot(x, direction, slot)
        offset = self._SPLICE_OFFSET[direction]
        if slot < offset:
            fmt = _formats(self._spliced_with)[direction == "bwd"]
            return fake_quantize(x, fmt, self._spliced_with.scaling)[0]
        return super()._quantize_slot(x, direction, slot - offset)

    def check_fp8_backend(self, fp8_recipe: Any, head_dim: int) -> None:
        """TE's ``get_attention_backend`` for FP8 on our layer: only cuDNN's FusedAttention runs
        FP8 in training, on SM 9.x with head_dim 128 and delayed scaling (current scaling and
        MXFP8 need SM 10.0+), on SM 10.0+ up to head_dim 128 in multiples of 16 (cuDNN's rule in
        fused_attn.cpp), never on SM 12.0; with no backend left TE raises this ValueError."""
        sm = get_device_compute_capability()
        reasons = []
        if sm < (9, 0):
            reasons.append("FP8 fused attention needs SM 9.0+")
        elif sm < (10, 0):
            if fp8_recipe.scaling != "delayed":
                reasons.append("Disabling FusedAttention for FP8 current scaling on arch < sm100")
            if head_dim != 128:
                reasons.append("FP8 fused attention on sm90 supports head_dim 128 only")
        elif sm == (12, 0):
            reasons.append("Disabling FusedAttention as FP8 is not supported for sm120")
        elif head_dim > 128 or head_dim % 16:
            reasons.append("FP8 fused attention on sm100+ supports head_dim <= 128, % 16 == 0")
        if reasons:
            raise ValueError(
                "No dot product attention backend is available for the provided inputs. "
                + "; ".join(reasons)
            )

    def cast(self, x: torch.Tensor, role: str) -> torch.Tensor:
        return _Fp8Cast.apply(x, self, role)


class _MultiheadAttention(nn.Module):
    def __init__(
        self, hidden: int, q_rows: int, kv_rows: int, dtype, device, init, out_init
    ) -> None:
        super().__init__()
        self.layernorm_qkv = _LayerNormLinear(hidden, q_rows + 2 * kv_rows, dtype, device, init)
        self.core_attention = _DotProductAttention()
        self.proj = Linear(
            q_rows, hidden, bias=False, init_method=out_init, params_dtype=dtype, device=device
        )


class _LayerNormMLP(_TEModule):
    """RMSNorm + SwiGLU MLP: ``layer_norm_weight``, ``fc1_weight`` ([gate; up]), ``fc2_weight``.

    Called as a module by ``TransformerLayer`` (as TE does), returning the MLP's output without
    the residual; with ``checkpoint`` set it keeps only its input and recomputes in backward.
    """

    def __init__(self, hidden: int, ffn: int, eps: float, dtype, device, init, out_init) -> None:
        super().__init__(num_gemms=2)
        self.eps = eps
        self._register(
            "layer_norm_weight", torch.empty(hidden, dtype=dtype, device=device), nn.init.ones_
        )
        self._register("fc1_weight", torch.empty(2 * ffn, hidden, dtype=dtype, device=device), init)
        self._register("fc2_weight", torch.empty(hidden, ffn, dtype=dtype, device=device), out_init)
        #: TE's selective recompute (``LayerNormMLP(checkpoint=...)``, TE >= 2.11), read at every
        #: forward; ``TransformerLayer`` builds the module without it (False).
        self.checkpoint = False
        self.reset_parameters(defer_init=device.type == "meta")

    @_te_kernels
    def forward(
        self, hidden_states: torch.Tensor, is_first_microbatch: bool | None = None
    ) -> torch.Tensor:
        if _STATE.enabled:  # TE's LayerNormMLP forward asserts this (layernorm_mlp.py)
            assert getattr(_STATE.recipe, "backward_override", None) is None, (
                "NVTE_BACKWARD_OVERRIDE=high_precision/dequantized is not implemented in "
                "LayerNormMLP. Replace LayerNormMLP with LayerNormLinear + Linear to enable "
                "high_precision/dequantized backward."
            )
        names = ("layer_norm_weight", "fc1_weight", "fc2_weight")
        params = [getattr(self, name) for name in names]
        dtype = _activation_dtype(hidden_states, params)
        weights = {f"layernorm_mlp.{n}": p.to(dtype) for n, p in zip(names, params, strict=True)}

        def linear(x: torch.Tensor, weight: torch.Tensor, which: str) -> torch.Tensor:
            return self._gemm(x, weight, {"fc1": 0, "fc2": 1}[which], is_first_microbatch)

        def run(x: torch.Tensor) -> torch.Tensor:
            return reference.mlp(x, weights, eps=self.eps, linear=linear)

        if self.checkpoint and torch.is_grad_enabled():  # TE's selective recompute
            return _recompute_replaying_fp8(run, [self], hidden_states)
        return run(hidden_states)


_LAYER_SUPPORTED = {
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_gqa_groups",
    "layernorm_epsilon",
    "hidden_dropout",
    "attention_dropout",
    "init_method",
    "output_layer_init_method",
    "layer_number",
    "kv_channels",
    "self_attn_mask_type",
    "params_dtype",
    "get_rng_state_tracker",
    "seq_length",
    "micro_batch_size",
    "fuse_qkv_params",
    "qkv_weight_interleaved",
    "bias",
    "activation",
    "normalization",
    "device",
    "attn_input_format",
    "name",
}


class TransformerLayer(nn.Module):
    """Pre-norm decoder layer; computes ``reference.transformer_layer``."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_attention_heads: int,
        num_gqa_groups: int | None = None,
        layernorm_epsilon: float = 1e-5,
        hidden_dropout: float = 0.1,
        attention_dropout: float = 0.1,
        init_method: Callable | None = None,
        output_layer_init_method: Callable | None = None,
        layer_number: int | None = None,
        kv_channels: int | None = None,
        self_attn_mask_type: str = "causal",
        window_size: tuple[int, int] | None = None,
        bottom_right_diagonal: bool | None = None,
        softcap: float = 0.0,
        enc_dec_attn_mask_type: str = "no_mask",
        enc_dec_bottom_right_diagonal: bool | None = None,
        enc_dec_window_size: tuple[int, int] | None = None,
        tp_group: Any = None,
        tp_size: int = 1,
        params_dtype: torch.dtype | None = None,
        get_rng_state_tracker: Callable | None = None,
        fuse_wgrad_accumulation: bool = False,
        seq_length: int | None = None,
        micro_batch_size: int | None = None,
        sequence_parallel: bool = False,
        apply_residual_connection_post_layernorm: bool = False,
        output_layernorm: bool = False,
        parallel_attention_mlp: bool = False,
        layer_type: str = "encoder",
        drop_path_rate: float = 0.0,
        set_parallel_mode: bool = False,
        fuse_qkv_params: bool = False,
        rotary_pos_interleaved: bool = False,
        zero_centered_gamma: bool = False,
        qkv_weight_interleaved: bool = True,
        ub_tp_comm_overlap: bool = False,
        ub_overlap_ag: bool = True,
        ub_overlap_rs: bool = True,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = True,
        ub_bulk_wgrad: bool = True,
        bias: bool = True,
        activation: str = "gelu",
        activation_params: dict | None = None,
        normalization: str = "LayerNorm",
        device: torch.device | str = "cuda",
        attn_input_format: str = "sbhd",
        name: str | None = None,
        qk_norm_type: str | None = None,
        qk_norm_eps: float = 1e-6,
        qk_norm_before_rope: bool = False,
        softmax_type: str = "vanilla",
    ) -> None:
        _refuse_unsupported(TransformerLayer.__init__, locals(), _LAYER_SUPPORTED)
        modelled = {
            "bias": (bias, False),
            "activation": (activation, "swiglu"),
            "normalization": (normalization, "RMSNorm"),
            "attn_input_format": (attn_input_format, "bshd"),
            "fuse_qkv_params": (fuse_qkv_params, True),
            "qkv_weight_interleaved": (qkv_weight_interleaved, False),
        }
        for arg, (value, wanted) in modelled.items():
            if value != wanted:
                raise NotImplementedError(f"the TE test double models only {arg}={wanted!r}")
        super().__init__()
        dtype = params_dtype or torch.get_default_dtype()
        dev = _resolve_device(device)
        default_init = lambda t: nn.init.normal_(t, 0.0, 0.023)  # noqa: E731  (TE's default)
        init = init_method or default_init
        out_init = output_layer_init_method or default_init
        self.num_heads = num_attention_heads
        self.num_groups = num_gqa_groups or num_attention_heads
        self.head_dim = kv_channels or hidden_size // num_attention_heads
        self.eps = layernorm_epsilon
        self.hidden_dropout, self.attention_dropout = hidden_dropout, attention_dropout
        self.self_attn_mask_type = self_attn_mask_type
        q_rows, kv_rows = self.num_heads * self.head_dim, self.num_groups * self.head_dim
        self.self_attention = _MultiheadAttention(
            hidden_size, q_rows, kv_rows, dtype, dev, init, out_init
        )
        self.layernorm_mlp = _LayerNormMLP(
            hidden_size, ffn_hidden_size, layernorm_epsilon, dtype, dev, init, out_init
        )

    @_te_kernels
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        self_attn_mask_type: str | None = None,
        window_size: tuple[int, int] | None = None,
        bottom_right_diagonal: bool | None = None,
        encoder_output: torch.Tensor | None = None,
        enc_dec_attn_mask: Any = None,
        enc_dec_attn_mask_type: str | None = None,
        enc_dec_window_size: tuple[int, int] | None = None,
        enc_dec_bottom_right_diagonal: bool | None = None,
        is_first_microbatch: bool | None = None,
        checkpoint_core_attention: bool = False,
        inference_params: Any = None,
        rotary_pos_emb: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: torch.Tensor | None = None,
        alibi_slopes: torch.Tensor | None = None,
        cu_seqlens_q: torch.Tensor | None = None,
        cu_seqlens_kv: torch.Tensor | None = None,
        cu_seqlens_q_padded: torch.Tensor | None = None,
        cu_seqlens_kv_padded: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_kv: int | None = None,
        fast_zero_fill: bool = True,
        pad_between_seqs: bool | None = None,
        thd_attention_policies: list[dict[str, Any]] | None = None,
        thd_attention_policy_dispatch: str = "auto",
        softcap: float | None = None,
    ) -> torch.Tensor:
        _refuse_unsupported(
            TransformerLayer.forward,
            locals(),
            {"hidden_states", "attention_mask", "self_attn_mask_type", "is_first_microbatch"}
            | {"rotary_pos_emb", "checkpoint_core_attention"},
        )
        mask_type = self_attn_mask_type or self.self_attn_mask_type
        if mask_type in ("padding", "arbitrary", "padding_causal") and attention_mask is not None:
            if attention_mask.dtype != torch.bool:
                raise TypeError("Attention mask must be a boolean tensor")
        attn = self.self_attention
        qkv, proj = attn.layernorm_qkv, attn.proj
        tensors = {
            "self_attention.layernorm_qkv.layer_norm_weight": qkv.layer_norm_weight,
            "self_attention.layernorm_qkv.weight": qkv.weight,
            "self_attention.proj.weight": proj.weight,
        }
        mlp = self.layernorm_mlp
        params = [*tensors.values(), mlp.layer_norm_weight, mlp.fc1_weight, mlp.fc2_weight]
        dtype = _activation_dtype(hidden_states, params)
        weights = {k: v.to(dtype) for k, v in tensors.items()}
        gemms = {"qkv": qkv, "proj": proj}

        def linear(x: torch.Tensor, weight: torch.Tensor, which: str) -> torch.Tensor:
            return gemms[which]._gemm(x, weight, 0, is_first_microbatch)

        if isinstance(rotary_pos_emb, tuple):
            rotary_pos_emb = rotary_pos_emb[0]
        if rotary_pos_emb is not None and rotary_pos_emb.shape[0] < hidden_states.shape[1]:
            raise ValueError("rotary_pos_emb covers fewer positions than the sequence")
        attention_cast = reference.no_cast
        if _STATE.enabled:
            core = attn.core_attention
            core._prepare_forward()
            if _STATE.recipe.fp8_dpa:
                core.check_fp8_backend(_STATE.recipe, self.head_dim)
                attention_cast = core.cast
        hidden = reference.attention_block(
            hidden_states.to(dtype),
            weights,
            num_heads=self.num_heads,
            num_groups=self.num_groups,
            head_dim=self.head_dim,
            eps=self.eps,
            rotary_pos_emb=rotary_pos_emb,
            mask_type=mask_type,
            attention_mask=attention_mask,
            linear=linear,
            attention_dropout=self.attention_dropout,
            hidden_dropout=self.hidden_dropout,
            training=self.training,
            attention_cast=attention_cast,
        )

        mlp_out = mlp(hidden, is_first_microbatch=is_first_microbatch)
        return hidden + F.dropout(mlp_out, p=self.hidden_dropout, training=self.training)


def _recompute_replaying_fp8(
    function: Callable,
    modules: list[_TEModule],
    *args: Any,
    own_autocast: bool = False,
    **kwargs: Any,
) -> Any:
    """Run ``function`` keeping only its inputs; recompute it in backward with the FP8 scaling
    state the forward used (TE's ``copy_forward_fp8_meta_tensors_for_recompute`` and
    ``get_old_fp8_meta_tensors_for_recompute``): the recompute reads the forward's delayed-scaling
    factors, records no amax, and leaves the factors as it found them. Shared by ``checkpoint``
    and ``LayerNormMLP``'s ``checkpoint=True``. Non-reentrant, torch's RNG state preserved.

    ``own_autocast`` (TE's ``checkpoint``): the recompute runs inside an ``autocast`` of its own,
    entered during backward, so its exit updates the forward scaling state like any outermost
    exit: all-reduces the (zero) row 0 and rolls every forward history one row. ``LayerNormMLP``
    restores the autocast state instead, with no exit.
    """
    use_reentrant = kwargs.pop("use_reentrant", False)
    forward_state = (_STATE.enabled, _STATE.recipe, _STATE.group)
    scales: dict[tuple[int, str], torch.Tensor] = {}
    calls = [0]

    def delayed_states() -> dict[tuple[int, str], Any]:
        return {
            (id(m), key): m.fp8_meta[key]
            for m in modules
            for key in ("scaling_fwd", "scaling_bwd")
            if hasattr(m.fp8_meta.get(key), "scale")
        }

    def run(*inner_args: Any, **inner_kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:  # the real forward: remember the scales it used
            out = function(*inner_args, **inner_kwargs)
            scales.update({k: state.scale.clone() for k, state in delayed_states().items()})
            return out
        # TE's checkpoint: ``autocast(enabled=fp8, recipe=fp8_recipe)`` around the recompute.
        outer = autocast(forward_state[0], recipe=forward_state[1]) if own_autocast else None
        with outer or contextlib.nullcontext():
            return replay(*inner_args, **inner_kwargs)

    def replay(*inner_args: Any, **inner_kwargs: Any) -> Any:
        saved = (_STATE.snapshot(), _STATE.recompute)
        states = delayed_states()
        current = {k: state.scale.clone() for k, state in states.items() if k in scales}
        _STATE.enabled, _STATE.recipe, _STATE.group = forward_state
        _STATE.recompute = True
        for k, scale in scales.items():
            states[k].scale.copy_(scale)
        try:
            return function(*inner_args, **inner_kwargs)
        finally:
            _STATE.restore(saved[0])
            _STATE.recompute = saved[1]
            for k, scale in current.items():
                states[k].scale.copy_(scale)

    if use_reentrant and kwargs:
        return torch.utils.checkpoint.checkpoint(
            functools.partial(run, **kwargs), *args, use_reentrant=True
        )
    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=use_reentrant, **kwargs)
