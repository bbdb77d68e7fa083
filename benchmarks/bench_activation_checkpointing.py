"""What each activation-checkpointing setting keeps for backward, and what its recompute costs.

    .venv/bin/python -m benchmarks.bench_activation_checkpointing            # Llama3-8B-shaped
    .venv/bin/python -m benchmarks.bench_activation_checkpointing --repeats 9 -- --num_layers 8

On the model train.py builds (FSDP2 on a world of one, this machine's device), for no AC, every
layer, every other layer, every MLP and every other MLP (``--activation_checkpointing``,
``--ac_every``, ``--ac_scope``):
  kept   the bytes autograd keeps for backward while inside the decoder layers (a saved-tensor
         hook around one forward), i.e. the activations AC exists to shed; each setting's
         share of what full recompute frees is printed beside it;
  time   the median wall time of one forward + backward (no optimizer: the part AC changes),
         inside the precision backend's autocast as in training;
  peak   on CUDA, the peak memory allocated over those forward + backward passes.
The default shape keeps Llama3-8B's proportions at 1/8 width (head_dim 128, 4:1 GQA, MLP 3.5x
the hidden width) on ``--model_impl hf`` (HF's layer, torch SDPA; its MLP recompute includes
fc2). On a GPU with TE, ``-- --model_impl te --fp8=1`` measures TE's layer, whose MLP
recompute is LayerNormMLP's own (benchmarks/gpu_levers.sh ac runs it at Llama3-8B width).
Not a test: timings depend on the machine; the byte counts do not.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks._common import build_model, median_seconds, options, random_batch, world_of_one
from model_utils.config import arguments
from model_utils.parallel import distributed
from model_utils.report.metrics.device import kept_activation_bytes

#: Llama3-8B / 8 in width, same head_dim, GQA ratio and MLP ratio; 4 layers, seq 1024.
LLAMA3_SHAPED = (
    "--preset=tiny --hidden_width=512 --num_heads=4 --num_key_value_heads=1 "
    "--intermediate_size=1792 --num_layers=4 --max_context_width=1024 --train_batch_size=2"
).split()
AC = "--activation_checkpointing"
SETTINGS: dict[str, list[str]] = {
    "no AC": [],
    "every layer": [AC],
    "every other layer": [AC, "--ac_every=2"],
    "every MLP": [AC, "--ac_scope=mlp"],
    "every other MLP": [AC, "--ac_scope=mlp", "--ac_every=2"],
}


@dataclass
class Built:
    """train.py's model for some flags, its precision backend, and one fixed batch."""

    model: nn.Module
    backend: Any  # precision.build_backend's: BF16, TorchaoFloat8 or TEBackend
    batch: torch.Tensor


def build(flags: list[str], device: torch.device) -> Built:
    args = arguments.parse_args(flags)
    model, backend = build_model(args, device)
    return Built(model, backend, random_batch(args, device, torch.Generator().manual_seed(0)))


def mlp_share(flags: list[str], device: torch.device) -> float:
    """The MLPs' share of what the decoder layers keep without AC."""
    run = build(flags, device)
    in_layers = kept_activation_bytes(run.model, run.batch, autocast=run.backend.autocast)[0]
    in_mlps = kept_activation_bytes(
        run.model,
        run.batch,
        lambda layer: layer.get_submodule(distributed.mlp_path(layer)),
        run.backend.autocast,
    )[0]
    return in_mlps / in_layers


def measure(flags: list[str], repeats: int, device: torch.device) -> tuple[int, float, float]:
    """Kept bytes, median forward + backward seconds, and (CUDA) peak GiB allocated."""
    run = build(flags, device)
    kept, loss = kept_activation_bytes(run.model, run.batch, autocast=run.backend.autocast)
    loss.backward()

    def forward_backward() -> None:
        with run.backend.autocast():
            loss = run.model(input_ids=run.batch, labels=run.batch).loss
        loss.backward()

    # The previous settings' models live on in reference cycles (FSDP2's hooks) until the
    # collector runs: on the H100 of 2026-11-24 each setting's peak included theirs (12.7,
    # 17.6, 25.8, 32.4 GiB in the order measured).
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    seconds = median_seconds(forward_backward, repeats, device)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return kept, seconds, peak


def main(argv: list[str] | None = None) -> None:
    cli = options(__doc__, repeats=5).parse_args(argv)  # repeats: forward + backward
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    world_of_one(device)
    rows = {
        name: measure([*LLAMA3_SHAPED, *flags, *cli.extra], cli.repeats, device)
        for name, flags in SETTINGS.items()
    }
    base_kept, base_time, _ = rows["no AC"]
    freed_by_full = base_kept - rows["every layer"][0]
    print(f"{device.type}, {' '.join([*LLAMA3_SHAPED, *cli.extra])}, median of {cli.repeats}")
    print(
        f"{'setting':<18} {'kept MiB':>9} {'vs none':>8} {'share freed':>12} "
        f"{'fwd+bwd s':>10} {'vs none':>8} {'peak GiB':>9}"
    )
    for name, (kept, seconds, peak) in rows.items():
        share = (base_kept - kept) / freed_by_full if freed_by_full else float("nan")
        peak_gib = f"{peak:.1f}" if peak else "-"
        print(
            f"{name:<18} {kept / 2**20:>9.1f} {kept / base_kept:>7.2f}x {share:>11.0%} "
            f"{seconds:>10.3f} {seconds / base_time:>7.2f}x {peak_gib:>9}"
        )
    print("share freed: of what recomputing every layer frees")
    share = mlp_share([*LLAMA3_SHAPED, *cli.extra], device)
    print(f"without AC, the MLPs keep {share:.0%} of what the decoder layers keep")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
