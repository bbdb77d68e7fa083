"""TEST DOUBLE of ``transformer_engine.pytorch.distributed``: TE's activation ``checkpoint``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """Recompute ``function`` in backward, replaying the forward's FP8 state like TE does.

    TE-only keyword arguments are popped (as TE does); the rest go to ``function``.
    """
    from transformer_engine.pytorch import _recompute_replaying_fp8, _TEModule

    use_reentrant = kwargs.pop("use_reentrant", True)
    kwargs.pop("distribute_saved_activations", False)
    kwargs.pop("tp_group", None)
    kwargs.pop("get_rng_state_tracker", None)
    for torch_only in ("context_fn", "determinism_check", "debug"):
        kwargs.pop(torch_only, None)
    if not torch.is_grad_enabled():  # like TE: nothing to recompute without autograd
        return function(*args, **kwargs)
    modules = (
        [m for m in function.modules() if isinstance(m, _TEModule)]
        if isinstance(function, nn.Module)
        else []
    )
    return _recompute_replaying_fp8(
        function, modules, *args, own_autocast=True, use_reentrant=use_reentrant, **kwargs
    )
