"""Train the tiny Llama for a few steps on fixed global batches, in several precision modes.

    torchrun --nproc_per_node=N tests/dist_scripts/parity.py OUT_DIR --modes bf16,fp8 [--hybrid]

Every world size sees the same global batch per step: rank r takes its slice of the rows, so a
1-rank and a 2-rank run must produce the same losses (up to reduction order). Rank 0 writes
OUT_DIR/parity_w<N>_<strategy>.json (per mode: losses, grad norms, float8 evidence) and
OUT_DIR/init_<mode>_w<N>_<strategy>.pt (the full parameters right after materialize).
"""

from __future__ import annotations

import argparse
import json
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common
import torch
import torch.distributed as dist
from torch import nn

from model_utils import optim
from model_utils.run.step import StepParts, clip_grad_norm, train_step

GLOBAL_BATCH = 4  # sequences per optimizer step, split evenly over the ranks
STEPS = 5
# Clipping runs (the global norm is reduced over the DTensor shards, as in train.py) but never
# binds: an active clip scales every gradient by a coefficient whose last bit depends on the
# order of the cross-rank norm reduction, and AdamW turns that ulp into ~1e-4 loss differences
# by step 4. With it inactive, 1 and 2 ranks agree bit for bit, so the test can demand that.
GRAD_CLIP = "1e6"
MODES: dict[str, list[str]] = {
    "bf16": ["--fp8=0"],
    "fp8": ["--fp8=1"],
    "fp8_ag": ["--fp8=1", "--fp8_all_gather=1"],
    "bf16_ac": ["--fp8=0", "--activation_checkpointing=1"],
    "fp8_ac_mlp": ["--fp8=1", "--activation_checkpointing=1", "--ac_scope=mlp"],
    "bf16_compile": ["--fp8=0", "--compile=1"],
    "fp8_ag_keep": ["--fp8=1", "--fp8_all_gather=1", "--reshard_after_forward=never"],
    "bf16_masters": ["--fp8=0", "--master_weights=optimizer"],
    "fp8_ag_masters": ["--fp8=1", "--fp8_all_gather=1", "--master_weights=optimizer"],
}


def global_batch(step: int, vocab: int, seq: int) -> torch.Tensor:
    """A learnable sequence family (x_{t+1} = 5 x_t + 3 mod V from a random start), so the loss
    falls quickly and a wrong update shows up in the loss within a step or two."""
    gen = torch.Generator().manual_seed(1234 + step)
    start = torch.randint(0, vocab, (GLOBAL_BATCH, 1), generator=gen)
    ids = [start]
    for _ in range(seq - 1):
        ids.append((ids[-1] * 5 + 3) % vocab)
    return torch.cat(ids, dim=1)


def micro_batches(
    batch: torch.Tensor, rank: int, world_size: int, accum: int
) -> list[torch.Tensor]:
    """This rank's micro-batches: the global batch cut into world_size * accum equal parts, part
    rank * accum + m for micro-batch m. One rank accumulating two parts therefore sees exactly
    the rows that two ranks see, which makes the runs comparable even under FP8, whose dynamic
    activation scales depend on which rows share a micro-batch."""
    parts = batch.chunk(world_size * accum)
    return list(parts[rank * accum : (rank + 1) * accum])


def micro_batch_source(micros: list[torch.Tensor]) -> Callable[[], tuple[dict, float]]:
    """train_step's data source over this rank's micro-batches (weight 1: all real data)."""
    parts = iter(micros)

    def next_micro_batch() -> tuple[dict, float]:
        ids = next(parts)
        return {"input_ids": ids, "labels": ids}, 1.0

    return next_micro_batch


class CollectiveRecorder:
    """Wraps the all-gather entry points FSDP2 may call and records (dtype, bytes) per call.

    Only the outermost call is recorded (one collective may forward to another)."""

    NAMES = ("all_gather_single", "all_gather_into_tensor")

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.enabled = False
        self._depth = threading.local()
        self._originals: dict[str, Callable] = {}

    def _wrap(self, name: str, fn: Callable) -> Callable:
        def wrapped(output_tensor, input_tensor, *args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            if self.enabled and depth == 0:
                self.calls.append(
                    {
                        "op": name,
                        "dtype": str(input_tensor.dtype),
                        "bytes": input_tensor.numel() * input_tensor.element_size(),
                    }
                )
            self._depth.n = depth + 1
            try:
                return fn(output_tensor, input_tensor, *args, **kwargs)
            finally:
                self._depth.n = depth

        return wrapped

    def install(self) -> None:
        for name in self.NAMES:
            self._originals[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name, self._originals[name]))


class Float8Evidence:
    """What torchao's float8 weights hand to FSDP2 and when the scales are precomputed."""

    def __init__(self) -> None:
        self.pre_all_gather: list[dict[str, Any]] = []
        self.precompute_calls = 0
        self.enabled = False

    def install(self) -> None:
        import torchao.float8 as ao_float8
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as Weight

        original_pre = Weight.fsdp_pre_all_gather
        original_precompute = ao_float8.precompute_float8_dynamic_scale_for_fsdp
        evidence = self

        # Same signature as torchao's: FSDP2 inspects it to decide how to call the hook.
        def pre_all_gather(self, mesh):
            outputs, metadata = original_pre(self, mesh)
            if evidence.enabled:
                for t in outputs:
                    evidence.pre_all_gather.append(
                        {"dtype": str(t.dtype), "bytes": t.numel() * t.element_size()}
                    )
            return outputs, metadata

        def precompute(module: nn.Module) -> None:
            evidence.precompute_calls += 1
            original_precompute(module)

        Weight.fsdp_pre_all_gather = pre_all_gather
        # The backend imports the function at call time, so the module attribute is what it gets.
        ao_float8.precompute_float8_dynamic_scale_for_fsdp = precompute


def scale_mismatches(model: nn.Module) -> list[str]:
    """Float8 weights whose precomputed scale is not fp8_max / amax of the *current* full weight,
    i.e. a scale that was not refreshed after the last optimizer step."""
    from torchao.float8.float8_linear import Float8Linear

    bad = []
    for name, module in model.named_modules():
        if not isinstance(module, Float8Linear):
            continue
        local = module.weight._local_tensor  # where torchao stores the scale
        scale = getattr(local, "_precomputed_scale", None)
        amax = common.plain(local).detach().abs().max().float().reshape(1)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
        expected = torch.finfo(torch.float8_e4m3fn).max / amax.double().clamp(min=1e-12)
        if scale is None or not torch.allclose(scale.double(), expected, rtol=1e-6):
            bad.append(f"{name}: scale {scale} expected {expected.item()}")
    return bad


def global_grad_norm(model: nn.Module) -> float:
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], norm_type=2.0)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def binding_clip(model: nn.Module, backend, args, world) -> dict[str, float]:
    """One more backward on the first batch, then train.py's clip with a limit that binds (half
    the norm): the global norm afterwards must be the limit on every world size, which fails if
    a rank scaled its shards by a coefficient from its local norm only."""
    ids = micro_batches(
        global_batch(0, args.model.vocab_size, args.model.max_context_width),
        world.rank,
        world.world_size,
        1,
    )[0]
    with backend.autocast():
        model(input_ids=ids, labels=ids).loss.backward()
    before = global_grad_norm(model)
    clip_grad_norm(model, before / 2)
    after = global_grad_norm(model)
    model.zero_grad(set_to_none=True)
    return {"before": before, "after": after, "limit": before / 2}


def linear_and_norm_numels(model: nn.Module) -> dict[str, int]:
    """Parameter elements of one decoder layer by kind, for the all-gather byte arithmetic."""
    layer = common.decoder_layer_params(model)
    return {
        "linear": sum(p.numel() for n, p in layer if p.ndim == 2),
        "norm": sum(p.numel() for n, p in layer if p.ndim == 1),
    }


def stored_dtypes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list]:
    """What the parameters, their local shards and any optimizer-held master copies are."""
    params = list(model.parameters())
    masters = [optimizer.state[p].get("master_param") for p in params]
    return {
        "params": sorted({str(p.dtype) for p in params}),
        "shards": sorted({type(p).__name__ for p in params}),
        "masters": sorted({str(m.dtype) for m in masters if m is not None}),
        "master_shards": sorted({type(m).__name__ for m in masters if m is not None}),
        "masters_kept": sum(m is not None for m in masters),
        "num_params": len(params),
    }


def run_mode(
    mode: str,
    hybrid: bool,
    accum: int,
    world,
    device: torch.device,
    out_dir: Path,
    recorder: CollectiveRecorder,
    evidence: Float8Evidence,
) -> dict[str, Any]:
    strategy = "hybrid" if hybrid else "full"
    args = common.parse_product_args(
        [
            *common.TINY_SHAPE,
            *MODES[mode],
            "--sharding_strategy",
            strategy,
            "--seed",
            "7",
            "--lr",
            "0.01",
            "--warmup",
            "2",
            "--max_steps",
            str(STEPS),
            "--output_dir",
            str(out_dir),
            "--grad_clip",
            GRAD_CLIP,
            "--grad_accum_steps",
            str(accum),
        ]
    )
    torch.manual_seed(args.run.seed)
    model, backend, mesh = common.build_sharded(args, world, device)
    init = common.full_parameters(model)
    if world.is_main:
        torch.save(init, out_dir / f"init_{mode}_w{world.world_size}_{strategy}.pt")
    optimizer, scheduler = optim.from_config(model, args.optim, args.run.max_steps)

    result: dict[str, Any] = {"losses": [], "grad_norms": [], "scale_mismatches": []}
    result["mesh"] = {"shape": list(mesh.shape), "dim_names": list(mesh.mesh_dim_names or ())}
    recorder.calls.clear()
    evidence.pre_all_gather.clear()
    evidence.precompute_calls = 0

    # Step 0 is recorded up to its optimizer step: forwards, backwards, the clip (no all-gather).
    def stop_recording(*_: Any) -> None:
        recorder.enabled = evidence.enabled = False

    optimizer.register_step_pre_hook(stop_recording)
    model.train()
    start = time.perf_counter()
    for step in range(STEPS):
        batch = global_batch(step, args.model.vocab_size, args.model.max_context_width)
        recorder.enabled = evidence.enabled = step == 0
        source = micro_batch_source(micro_batches(batch, world.rank, world.world_size, accum))
        done = train_step(StepParts(model, optimizer, scheduler, backend, args, device), source)
        if args.precision.fp8_all_gather:
            result["scale_mismatches"].append(scale_mismatches(model))
        total = done.loss.double().reshape(1)
        dist.all_reduce(total)
        grad_norm = done.grad_norm
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        result["losses"].append(total.item() / world.world_size)
        result["grad_norms"].append(float(grad_norm))
    result["all_gathers"] = list(recorder.calls)
    result["pre_all_gather"] = list(evidence.pre_all_gather)
    result["precompute_calls"] = evidence.precompute_calls
    result["float8_linears"] = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    result["layer_numels"] = linear_and_norm_numels(model)
    result["binding_clip"] = binding_clip(model, backend, args, world)
    result["dtypes"] = stored_dtypes(model, optimizer)
    result["seconds"] = time.perf_counter() - start
    result["finite"] = all(math.isfinite(x) for x in result["losses"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--modes", default="bf16")
    parser.add_argument("--hybrid", action="store_true")
    parser.add_argument("--grad_accum", type=int, default=1, help="micro-batches per rank")
    cli = parser.parse_args()

    world, device = common.start_world()
    recorder, evidence = CollectiveRecorder(), Float8Evidence()
    recorder.install()
    evidence.install()
    results = {
        "world_size": world.world_size,
        "num_nodes": world.num_nodes,
        "modes": {},
    }
    try:
        for mode in cli.modes.split(","):
            results["modes"][mode] = run_mode(
                mode, cli.hybrid, cli.grad_accum, world, device, cli.out_dir, recorder, evidence
            )
    finally:
        common.distributed.cleanup()
    strategy = "hybrid" if cli.hybrid else "full"
    if world.is_main:
        path = cli.out_dir / f"parity_w{world.world_size}_{strategy}.json"
        path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
