"""Shared helpers of the scripts that tests/integration/test_distributed.py runs under torchrun.

The scripts build the model with the product's own functions (arguments -> modeling.build ->
precision backend.prepare -> distributed.shard -> modeling.materialize -> optim) so that what is
tested is the lead's code, not a re-implementation of it.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import train
from model_utils.config import arguments
from model_utils.parallel import distributed
from model_utils.precision import backends as precision

REPO = Path(__file__).resolve().parents[2]


# A Llama small enough for milliseconds per step whose linears all qualify for FP8 (dims % 16).
TINY_SHAPE = [
    "--hidden_width",
    "64",
    "--num_layers",
    "2",
    "--num_heads",
    "4",
    "--num_key_value_heads",
    "2",
    "--intermediate_size",
    "128",
    "--vocab_size",
    "256",
    "--max_context_width",
    "32",
]


def parse_product_args(extra: list[str]) -> argparse.Namespace:
    """The product's own flag parsing and precision resolution (as train.validate does)."""
    return arguments.parse_args(["--preset", "tiny", *extra])


def start_world(timeout_s: int = 60) -> tuple[distributed.World, torch.device]:
    """The process group exactly as train.main starts it."""
    world = distributed.world_from_env()
    device = distributed.device_for(world)
    distributed.init(world, device, timeout_s)
    return world, device


def build_sharded(
    args: argparse.Namespace, world: distributed.World, device: torch.device
) -> tuple[nn.Module, object, DeviceMesh]:
    """train.train's model construction, step by step; returns (model, backend, mesh)."""
    mesh = distributed.build_mesh(world, device, args.parallel.sharding_strategy)
    backend = precision.build_backend(args, device)
    return train.build_model(args, mesh, device, backend), backend, mesh


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """Unwrap tensor subclasses (torchao's float8 weight wrapper) down to the stored values."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    while is_traceable_wrapper_subclass(tensor):
        inner, _ = tensor.__tensor_flatten__()
        tensor = getattr(tensor, inner[0])
    return tensor


def clean_name(name: str) -> str:
    """Parameter name without activation-checkpoint / compile wrapper prefixes."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered in full (a collective: all ranks must call it)."""
    out = {}
    for name, param in model.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        out[clean_name(name)] = plain(full).detach().float().clone()
    return out


def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident set (VmRSS) or its peak (VmHWM), from /proc."""
    with open(f"/proc/{os.getpid()}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def decoder_layer_params(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The (global-shaped) parameters of the first decoder layer, one FSDP2 all-gather group."""
    return list(distributed.decoder_layers(model)[0].named_parameters())
