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
        saved = (_STATE.enabled, _STATE.recipe, _STATE.group, _STATE.recompute)
        states = delayed_states()
        current = {k: state.scale.clone() for k, state in states.items() if k in scales}
        _STATE.enabled, _STATE.recipe, _STATE.group = forward_state
        _STATE.recompute = True
        for k, scale in scales.items():
            states[k].scale.copy_(scale)
        try:
            return function(*inner_args, **inner_kwargs)
        finally:
            _STATE.enabled, _STATE.recipe, _STATE.group, _STATE.recompute = saved
            for k, scale in current.items():
                states[k].scale.copy_(scale)

    if use_reentrant and kwargs:
        return torch.utils.checkpoint.checkpoint(
            functools.partial(run, **kwargs), *args, use_reentrant=True
        )
    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=use_reentrant, **kwargs)
