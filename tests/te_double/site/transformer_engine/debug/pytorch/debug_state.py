"""TEST DOUBLE of TE's ``debug/pytorch/debug_state.py`` (``TEDebugState``), with what TE keeps
in ``debug/features/utils/stats_buffer.py``: the statistics fed during a step, reduced over the
ranks and logged (``MetricLogger.log_scalar("<layer>_<tensor>_<stat>", value, iteration)``) at
``debug_api.step()``. Here, not in ``features/``: nvdlfw-inspect executes every file there as a
module of its own, and the buffer must be one."""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist

#: Per statistic: how micro-batches and ranks combine it.
_COMBINE = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "sum": dist.ReduceOp.SUM}


class TEDebugState:
    """TE's: whether the debug tools were initialised when the first TE module was built."""

    layer_count = 1
    debug_enabled: bool | None = None

    @classmethod
    def initialize(cls) -> None:
        """Called by every TE module's constructor, as TE's base module does."""
        if "nvdlfw_inspect" in sys.modules:
            import nvdlfw_inspect.api as debug_api

            if cls.debug_enabled is False and debug_api.DEBUG_MANAGER is not None:
                raise RuntimeError(
                    "[nv_dlfw_inspect] nv_dlfw_inspect module should be initialized before"
                    " initialization of the first TE module"
                )
            cls.debug_enabled = debug_api.DEBUG_MANAGER is not None

    @classmethod
    def _reset(cls) -> None:
        STATS.clear()
        cls.debug_enabled = None

    @classmethod
    def get_layer_count(cls) -> int:
        count, cls.layer_count = cls.layer_count, cls.layer_count + 1
        return count

    @classmethod
    def get_iteration(cls) -> int:
        import nvdlfw_inspect.api as debug_api

        return debug_api.DEBUG_MANAGER._trainer_iteration_count


class _Stats:
    """(layer, tensor) -> parts -> (value, how it combines); weights are not accumulated over
    micro-batches (TE's ``reduce_within_microbatch``), the other tensors are."""

    def __init__(self) -> None:
        self.parts: dict[tuple[str, str], dict[str, tuple[torch.Tensor, str]]] = {}
        self.wanted: dict[tuple[str, str], list[str]] = {}
        self.iteration = 0

    def clear(self) -> None:
        self.parts, self.wanted = {}, {}

    def feed(self, layer: str, tensor: str, stats: list[str], parts: dict, iteration: int) -> None:
        key = (layer, tensor)
        self.wanted[key] = sorted({*self.wanted.get(key, []), *stats})
        self.iteration = iteration
        held = self.parts.setdefault(key, {})
        for name, (value, how) in parts.items():
            if name in held and tensor != "weight":
                old = held[name][0]
                value = {"max": torch.maximum, "min": torch.minimum, "sum": torch.add}[how](
                    old, value
                )
            held[name] = (value.float(), how)

    def log(self) -> None:
        from nvdlfw_inspect.logging import MetricLogger

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            for key in sorted(self.parts):
                for name in sorted(self.parts[key]):
                    value, how = self.parts[key][name]
                    dist.all_reduce(value, op=_COMBINE[how])
        for (layer, tensor), parts in self.parts.items():
            for stat in self.wanted[(layer, tensor)]:
                value = _final(stat, {name: value for name, (value, _) in parts.items()})
                MetricLogger.log_scalar(f"{layer}_{tensor}_{stat}", value, self.iteration)
        self.parts = {}


def _final(stat: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    if stat.endswith("%"):
        return 100 * parts[stat[:-1] + "_num"] / parts["numel"]
    return parts[stat]


STATS = _Stats()


def inspect_gemm_operand(
    layer_name: str, tensor_name: str, tensor: torch.Tensor, quantized: Any, recipe_name: str
) -> None:
    """What TE's debug quantizer does for a GEMM operand it casts: ask the features whether
    they run this iteration, then hand them the tensor and its cast."""
    import nvdlfw_inspect.api as debug_api

    iteration = TEDebugState.get_iteration()
    api = debug_api.transformer_engine
    enabled = api.inspect_tensor_enabled(
        layer_name=layer_name, tensor_name=tensor_name, iteration=iteration
    )
    if not (enabled[0] if isinstance(enabled, tuple) else enabled):
        return
    api.inspect_tensor(
        layer_name=layer_name,
        tensor_name=tensor_name,
        iteration=iteration,
        tp_group=None,
        tensor=tensor,
        rowwise_quantized_tensor=quantized,
        columnwise_quantized_tensor=quantized,
        quantizer=recipe_name,
        tp_size=1,
    )
