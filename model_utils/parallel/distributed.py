"""Process group, device mesh and FSDP2 wrapping.

One code path for every launch: torchrun (RANK/WORLD_SIZE/LOCAL_RANK), plain srun (SLURM_PROCID,
SLURM_NTASKS, SLURM_LOCALID) and a single process on a laptop (a world of one). Even a single
process gets a process group and FSDP2, so what runs in CI is what runs on the cluster.
"""

from __future__ import annotations

import copy
import hashlib
import os
import re
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from model_utils.config.families import family_of
from model_utils.config.sections import ParallelConfig
from model_utils.errors import UsageError
from model_utils.parallel.fp8_reduce import CountedReduceScatter, Fp8ReduceScatter

if TYPE_CHECKING:
    from model_utils.config.run_config import Config


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // self.local_world_size)


def _first_int(env: Mapping[str, str], names: tuple[str, ...], default: int) -> int:
    for name in names:
        match = re.match(r"\d+", env.get(name, ""))
        if match:  # Slurm's per-node counts read "8(x2)" or "8,4": the first node's count
            return int(match.group())
    return default


def world_from_env(env: Mapping[str, str] = os.environ) -> World:
    """torchrun's variables first, then Slurm's (srun, one task per GPU), else a world of one."""
    world_size = _first_int(env, ("WORLD_SIZE", "SLURM_NTASKS"), 1)
    rank = _first_int(env, ("RANK", "SLURM_PROCID"), 0)
    local_rank = _first_int(env, ("LOCAL_RANK", "SLURM_LOCALID"), 0)
    # srun sets SLURM_NTASKS_PER_NODE only with --ntasks-per-node; SLURM_TASKS_PER_NODE always.
    local_world = _first_int(
        env, ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"), world_size
    )
    return World(rank, world_size, local_rank, min(local_world, world_size))


def resolve_global_batch(config: Config) -> Config:
    """--global_batch_size as each rank's micro-batches a step on the ranks of this launch."""
    total, world_size = config.optim.global_batch_size, world_from_env().world_size
    if total is None:
        return config
    per_pass = config.data.train_batch_size * world_size
    if total % per_pass:
        raise UsageError(
            f"--global_batch_size {total} is not a multiple of --train_batch_size "
            f"{config.data.train_batch_size} x {world_size} ranks ({per_pass}): give a multiple"
        )
    return config.replace(grad_accum_steps=total // per_pass)


def device_for(world: World) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", world.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def _slurm_master_addr() -> str:
    """First host of the allocation, the same choice the sbatch script makes for torchrun."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        return "127.0.0.1"
    import subprocess

    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError:  # no Slurm client tools here (a container): the list's first host, by hand
        first = re.match(r"([^,\[]+)(?:\[([^,\-\]]+))?", nodelist)  # gpu-[01-04,07] -> gpu-01
        return first[1] + (first[2] or "") if first else "127.0.0.1"
    hosts = out.stdout.split()
    return hosts[0] if hosts else "127.0.0.1"


def init(world: World, device: torch.device, timeout_s: int) -> None:
    """Start the process group: NCCL on GPUs, gloo on CPU.

    The timeout turns a dead peer into an error on every surviving rank instead of a hang.
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    if world.world_size == 1 and "MASTER_ADDR" not in os.environ:
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
        return
    if "MASTER_ADDR" not in os.environ:  # plain srun: derive the rendezvous from Slurm
        os.environ["MASTER_ADDR"] = _slurm_master_addr()
        job_id = int(os.environ.get("SLURM_JOB_ID", "0"))
        os.environ.setdefault("MASTER_PORT", str(29500 + job_id % 1000))
    dist.init_process_group(
        backend,
        rank=world.rank,
        world_size=world.world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )


def run_group_options(device: torch.device) -> Any:
    """A copy of the default group's backend options, which hold --dist_timeout. A group split
    from it (a mesh's, the preflight's) is otherwise given torch's default timeout (10 minutes
    on NCCL, 30 on gloo), whatever --dist_timeout says."""
    options = dist.distributed_c10d._get_default_group()._get_backend(device).options
    if device.type == "cuda":  # NCCL's, copied as torch's own split copies them
        return copy.deepcopy(options)
    return torch._C._distributed_c10d.Backend.Options("gloo", options._timeout)  # gloo's: no copy


def build_mesh(world: World, device: torch.device, strategy: str) -> DeviceMesh:
    """1-D mesh for FSDP (the default group itself); 2-D (replicate across nodes, shard within a
    node) for HSDP, its groups with the run's timeout."""
    if strategy == "hybrid":
        mesh = init_device_mesh(
            device.type,
            (world.num_nodes, world.world_size // world.num_nodes),
            mesh_dim_names=("replicate", "shard"),
            backend_override={d: run_group_options(device) for d in ("replicate", "shard")}
            if world.num_nodes > 1  # one node: the shard group is the default group itself
            else None,
        )
    else:
        mesh = init_device_mesh(device.type, (world.world_size,), mesh_dim_names=("shard",))
    # torch keeps hash(mesh), which differs per process (seeded strings, None's address on 3.11),
    # in mesh._hash, and inductor's FX graph cache pickles it into its keys: every process missed
    # the cache and compiled torchao's optimizer step anew. A hash of what makes meshes equal:
    key = repr((mesh.mesh.tolist(), mesh.device_type, mesh.mesh_dim_names)).encode()
    mesh._hash = int.from_bytes(hashlib.blake2b(key, digest_size=7).digest(), "big") or 1
    return mesh


def describe_rank(world: World, mesh: DeviceMesh) -> str:
    """Where this rank runs and whom it shards and replicates with, e.g. 'rank 1/4 on host-b:
    mesh replicate=2 x shard=2, replicate group [1, 3], shard group [0, 1]'."""
    dims = " x ".join(
        f"{name}={size}" for name, size in zip(mesh.mesh_dim_names, mesh.shape, strict=True)
    )
    groups = ", ".join(
        f"{name} group {dist.get_process_group_ranks(mesh.get_group(name))}"
        for name in mesh.mesh_dim_names
    )
    return f"rank {world.rank}/{world.world_size} on {socket.gethostname()}: mesh {dims}, {groups}"


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers (FSDP, recompute and compile units), where the model's family says."""
    return model.get_submodule(family_of(model.config).decoder_path)


def checkpointed_layers(num_layers: int, every: int) -> list[int]:
    """Which layers recompute: every ``every``-th, counted from the last.

    Every layer (``every=1``) keeps one layer's activations at a time; every other layer
    (``every=2``) keeps about half the activations for half the recompute, torchtitan's
    selective-by-layer option. Which half is stored does not change the peak (the sum of what
    forward keeps); counting from the end matches torchtitan's choice for an even depth.
    """
    return [i for i in range(num_layers) if (num_layers - 1 - i) % every == 0]


def apply_activation_checkpointing(
    model: nn.Module, checkpoint_fn=None, every: int = 1, scope: str = "layer"
) -> None:
    """Recompute in backward every ``every``-th decoder layer, whole (``scope="layer"``) or only
    its MLP (``scope="mlp"``).

    The MLP keeps about 3/4 of a Llama layer's activations (the 2 x ffn-wide gate/up output and
    the activation; flash attention keeps little). TE's fused ``layernorm_mlp`` has its own
    recompute (``LayerNormMLP(checkpoint=True)``, TE >= 2.11): it saves only the input, replays
    the forward's FP8 scaling state, and skips fc2, whose output backward does not need, so it
    redoes ~47% of a Llama3-8B layer's forward FLOPs at seq 8192 to free ~2/3 of its
    activations (every other layer: 50% for 1/2). ``TransformerLayer`` builds that module
    without the option and reads the attribute at every forward, so it is set on the built
    module. HF layouts (``hf``, ``te_linear``) wrap ``mlp`` like a layer (fc2 included).
    """
    layers = decoder_layers(model)
    for i in checkpointed_layers(len(layers), every):
        if scope == "layer":
            layers[i] = _recomputed(layers[i], checkpoint_fn)
        else:
            _recompute_mlp(layers[i], checkpoint_fn)


#: Where each layout's decoder layer keeps its MLP, and how that MLP recomputes: HF's
#: decoder layer (``hf``, ``te_linear``) behind a checkpoint wrapper; te_llama's
#: ``TELlamaDecoderLayer`` through TE's own flag on the fused ``LayerNormMLP``.
MLP_SITES: dict[str, str] = {"mlp": "wrapper", "transformer_layer.layernorm_mlp": "te_flag"}


def mlp_path(layer: nn.Module) -> str:
    """Where ``layer`` keeps its MLP (a key of ``MLP_SITES``)."""
    for path in MLP_SITES:
        try:
            layer.get_submodule(path)
        except AttributeError:
            continue
        return path
    raise ValueError(f"{type(layer).__name__} has no MLP at {' or '.join(MLP_SITES)}")


def _recompute_mlp(layer: nn.Module, checkpoint_fn=None) -> None:
    path = mlp_path(layer)
    mlp = layer.get_submodule(path)
    if MLP_SITES[path] == "te_flag":
        mlp.checkpoint = True
    else:
        layer.set_submodule(path, _recomputed(mlp, checkpoint_fn))


def _recomputed(module: nn.Module, checkpoint_fn=None) -> nn.Module:
    """``module`` behind a non-reentrant checkpoint wrapper (state-dict keys unchanged)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    kw = {"checkpoint_fn": checkpoint_fn} if checkpoint_fn is not None else {}
    return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kw)


#: Name segments the wrappers add (activation checkpointing, torch.compile, FSDP1): they do not
#: belong to a parameter's identity, so init seeds and weight mappings strip them.
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_param_name(name: str) -> str:
    """``name`` without wrapper segments: the same name with or without AC/compile wrapping."""
    for segment in WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def apply_compile(model: nn.Module) -> None:
    """Compile layer by layer (in place, so parameter names stay the same for checkpoints)."""
    for layer in decoder_layers(model):
        layer.compile()


def shard(model: nn.Module, mesh: DeviceMesh, parallel: ParallelConfig, bf16: bool) -> nn.Module:
    """FSDP2 units as torchtitan draws them: the embedding, each decoder layer, the final norm
    with ``lm_head``, and the root (what is left: rotary buffers).

    Embedding and ``lm_head`` are the two vocab-sized matrices (1.05B parameters for Llama 3);
    as their own units they are gathered only while used, not for the whole step as in the
    root. bf16 parameters for compute and fp32 gradient reduction (--reduce_dtype: bf16, or
    fp8_reduce.py's 8-bit wire; each reduce-scatter counts its bytes); master weights stay fp32:
    the parameters themselves, or with --master_weights optimizer (bf16 parameters, which the
    policy then leaves uncast) the optimizer's copies.

    ``--sharding_strategy none`` (a world of one) leaves the model as it is: no shards to
    gather, so none of FSDP2's per-step copies, events and DTensor swaps; the precision
    backend's torch.autocast computes in bf16 instead (backends.autocast_dtype).
    """
    if parallel.sharding_strategy == "none":
        model.model.embed_tokens.register_forward_hook(_rows_in_autocast_dtype)
        return model
    compute = torch.bfloat16 if bf16 else torch.float32
    reduce = torch.bfloat16 if parallel.reduce_dtype == "bf16" else torch.float32
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce)
    units = fsdp_units(model, parallel.reshard_after_forward)
    for unit, reshard in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    comm = Fp8ReduceScatter() if parallel.reduce_dtype == "fp8" else CountedReduceScatter()
    model.grad_reduce_scatter = comm  # its bytes go to the run's records (report/run_log.py)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(comm)
    return model


def _rows_in_autocast_dtype(module: nn.Module, args: Any, rows: torch.Tensor) -> torch.Tensor:
    """The embedding's rows in autocast's dtype (autocast leaves a lookup in fp32): the residual
    stream then runs in bf16, as it does from FSDP2's bf16 parameters."""
    device_type = rows.device.type
    if torch.is_autocast_enabled(device_type):
        return rows.to(torch.get_autocast_dtype(device_type))
    return rows


def fsdp_units(
    model: nn.Module, policy: str = "default"
) -> list[tuple[nn.Module | list[nn.Module], bool]]:
    """(module or module group, reshard after forward) in forward order, root excluded.

    ``default``: the last layer and ``[norm, lm_head]`` stay gathered after forward: backward
    needs them first, so resharding would only gather them again at once (torchtitan's
    choice). ``never`` keeps every unit gathered from its forward to its backward (ZeRO-2's
    memory: the bf16 parameters of the whole model, once), so backward neither gathers nor
    casts fp32 -> bf16 again; ``always`` reshards every unit (the least memory).

    Tied embeddings (one matrix for embed_tokens and lm_head) are one unit with the final
    norm: one parameter gathered once per step and one gradient reduced, its two uses summed.
    """
    layers = decoder_layers(model)
    tied = has_tied_embeddings(model)
    head = [model.model.norm, model.lm_head]
    units: list[tuple[nn.Module | list[nn.Module], bool]] = []
    if not tied:
        units.append((model.model.embed_tokens, True))
    units += [(layer, i < len(layers) - 1) for i, layer in enumerate(layers)]
    units.append(([model.model.embed_tokens, *head] if tied else head, False))
    if policy == "default":
        return units
    return [(unit, policy == "always") for unit, _ in units]


def has_tied_embeddings(model: nn.Module) -> bool:
    """One parameter is both the input embedding and lm_head (Llama 3.2's tie_word_embeddings)."""
    return model.lm_head.weight is model.model.embed_tokens.weight


def unwrapped(tensor: torch.Tensor) -> torch.Tensor:
    """Unwrap tensor subclasses (e.g. torchao's WeightWithDynamicFloat8CastTensor) to a plain
    tensor holding the high-precision values."""
    while is_traceable_wrapper_subclass(tensor):
        inner, _ = tensor.__tensor_flatten__()
        tensor = getattr(tensor, inner[0])
    return tensor


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; any other tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_index(target: torch.Tensor) -> tuple[slice, ...]:
    """This rank's block of the global tensor, as slices (all of it for a plain tensor)."""
    if not isinstance(target, DTensor):
        return tuple(slice(0, n) for n in target.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        target.shape, target.device_mesh, target.placements
    )
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def sync_gradients(model: nn.Module, strategy: str, last_micro: bool) -> None:
    """How gradients of one micro-batch are reduced, as torchtitan does it.

    Every micro-batch is reduce-scattered within the shard group: FSDP2 with gradient sync off
    would keep each gradient *unsharded* in fp32 until the last micro-batch (4 bytes x
    parameters per rank: 32 GB for Llama3-8B, an OOM from 13B up). Only HSDP's all-reduce across
    replicas (the inter-node traffic) waits for the last micro-batch.
    """
    if strategy == "hybrid":
        model.set_requires_all_reduce(last_micro)


# This process's place among the ranks and the few collectives the stages need, each safe in a
# world of one (no process group yet), so the checks that read no tensors run before
# torch.distributed is initialised.


def current_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's `obj` (a world of one without a process group: [obj])."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is true on any (e.g. a signal that reached some ranks)."""
    return any(all_gather_object(bool(flag)))


def first_problem(problem: str | None) -> str | None:
    """The lowest rank's problem line, or None, on every rank: a check that each rank makes
    on its own (its data shard, its checkpoint mount) must stop all ranks with the same line,
    or the healthy ones would wait in the next collective forever."""
    return next((p for p in all_gather_object(problem) if p), None)


# How long cleanup() hands the GIL to gloo's worker threads before the interpreter shuts down.
GLOO_RELEASE_GRACE_S = 0.2


def cleanup() -> None:
    """Leave the process group, then give gloo's worker threads a moment before exiting.

    A gloo worker thread drops a finished collective's tensors just after the collective
    returns, and that takes the GIL. If the interpreter is already shutting down, CPython 3.11
    ends the thread by unwinding it through a C++ destructor: std::terminate, SIGABRT, and a
    run that finished and saved is reported to Slurm as failed. destroy_process_group does not
    stop those threads here: once any DTensor op has run (fully_shard runs one to make each
    parameter), torch 2.13 holds the gloo group from C++ (both worker threads run on after
    destroy_process_group, with no Python reference left and DTensor's Python caches cleared).
    Sleeping hands the GIL over so a pending drop finishes first. This narrows the window (the
    thread must be scheduled within the grace) rather than closing it; the tests' spawned ranks
    close it by skipping interpreter shutdown (tests/helpers/procs.py).
    """
    if dist.is_initialized():
        dist.destroy_process_group()
        time.sleep(GLOO_RELEASE_GRACE_S)
