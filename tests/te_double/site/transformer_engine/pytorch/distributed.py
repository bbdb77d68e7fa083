"""TEST DOUBLE of ``transformer_engine.pytorch.distributed``: TE's activation ``checkpoint``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """Recompute ``function`` in backward, replaying the forward's FP8 state like TE does.

    TE-only keyword arguments are popped (as TE does); the rest go to ``function``.
    """
    from transformer_engine.pytorch import _STATE, _TEModule

    use_reentrant = kwargs.pop("use_reentrant", True)
    kwargs.pop("distribute_saved_activations", False)
    kwargs.pop("tp_group", None)
    kwargs.pop("get_rng_state_tracker", None)
    for torch_only in ("context_fn", "determinism_check", "debug"):
        kwargs.pop(torch_only, None)
    if not torch.is_grad_enabled():  # like TE: nothing to recompute without autograd
        return function(*args, **kwargs)

    forward_state = (_STATE.enabled, _STATE.recipe, _STATE.group)
    modules = (
        [m for m in function.modules() if isinstance(m, _TEModule)]
        if isinstance(function, nn.Module)
        else []
    )
    scales: dict[int, dict[str, torch.Tensor]] = {}
    calls = [0]

    def run(*inner_args: Any, **inner_kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:  # the real forward: remember the scales it used
            out = function(*inner_args, **inner_kwargs)
            for m in modules:
                scales[id(m)] = {
                    k: v.clone() for k, v in m.fp8_meta.items() if k.startswith("scale_")
                }
            return out
        saved = (_STATE.enabled, _STATE.recipe, _STATE.group, _STATE.recompute)
        current = {id(m): {k: m.fp8_meta[k] for k in scales.get(id(m), {})} for m in modules}
        _STATE.enabled, _STATE.recipe, _STATE.group = forward_state
        _STATE.recompute = True
        for m in modules:
            m.fp8_meta.update(scales.get(id(m), {}))
        try:
            return function(*inner_args, **inner_kwargs)
        finally:
            _STATE.enabled, _STATE.recipe, _STATE.group, _STATE.recompute = saved
            for m in modules:
                m.fp8_meta.update(current[id(m)])

    if use_reentrant and kwargs:
        return torch.utils.checkpoint.checkpoint(
            functools.partial(run, **kwargs), *args, use_reentrant=True
        )
    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=use_reentrant, **kwargs)
