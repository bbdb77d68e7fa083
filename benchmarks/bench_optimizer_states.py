"""Optimizer-state memory and final loss of --optimizer adamw | adamw8bit | adamw_fp8.

    python -m benchmarks.bench_optimizer_states                  # 200 tiny steps per optimizer
    python -m benchmarks.bench_optimizer_states --steps 50       # quicker

Three measurements, each from the real objects:
1. bytes of optimizer state per parameter on the tiny model as train.py builds it (FSDP2, world
   of one), counted from the state tensors after one step (optim.optimizer_state_bytes: DTensor
   shards, torchao's codes + scales + quantile map, fp32 where torchao keeps fp32);
2. the same for the tensors one rank holds of llama3-70b on 64 ranks (one decoder layer's shards
   plus the embedding's and lm_head's), stepped once as plain tensors of those shard shapes:
   the per-GPU figure of a memory-bound 70B run, without a 70B model;
3. train.py, one process, `--steps` tiny steps per optimizer (same seed, data and schedule):
   final train loss (mean of the last 10 steps), final validation loss, and the median step
   time after warm-up (CPU: says nothing about GPU speed), each against adamw's.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from benchmarks._common import COUNT, train_subprocess
from model_utils.errors import OneLineParser

OPTIMIZERS = ("adamw", "adamw8bit", "adamw_fp8")
TINY = ["--preset=tiny", "--train_batch_size=4", "--max_context_width=128"]


def tiny_state_bytes(name: str) -> tuple[float, int]:
    """(bytes per parameter, parameters) of the tiny model's optimizer after one step."""
    import torch

    from benchmarks._common import build_model, world_of_one
    from model_utils import optim
    from model_utils.config.arguments import parse_args

    device = torch.device("cpu")
    world_of_one(device)
    args = parse_args([*TINY, f"--optimizer={name}", "--max_steps=10"])
    model, _ = build_model(args, device)
    optimizer, _ = optim.from_config(model, args.optim, args.run.max_steps)
    ids = torch.randint(
        0, args.model.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0)
    )
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    params = sum(p.numel() for p in model.parameters())
    return optim.optimizer_state_bytes(optimizer) / params, params


def llama70b_shard_bytes(name: str, ranks: int) -> tuple[float, int]:
    """(bytes per parameter, parameters) of one rank's optimizer over llama3-70b shard shapes:
    one decoder layer, the embedding and lm_head, each weight's first dim split `ranks` ways."""
    import torch

    from model_utils import optim
    from model_utils.config.presets import PRESETS

    p = PRESETS["llama3-70b"]
    head_dim = p.hidden_width // p.num_heads
    kv = p.num_key_value_heads * head_dim
    shapes = [
        (p.vocab_size, p.hidden_width),  # embed_tokens
        (p.vocab_size, p.hidden_width),  # lm_head
        (p.hidden_width, p.hidden_width),
        (kv, p.hidden_width),
        (kv, p.hidden_width),  # q k v
        (p.hidden_width, p.hidden_width),  # o
        (p.intermediate_size, p.hidden_width),
        (p.intermediate_size, p.hidden_width),  # gate up
        (p.hidden_width, p.intermediate_size),  # down
        (p.hidden_width,),
        (p.hidden_width,),  # the layer's two RMSNorm gains
    ]
    module = torch.nn.Module()
    for i, shape in enumerate(shapes):
        rows = -(-shape[0] // ranks)  # FSDP2's first-dim chunk (torch.chunk) of rank 0
        local = torch.nn.Parameter(torch.zeros(rows, *shape[1:]))
        module.register_parameter(f"w{i}" if len(shape) > 1 else f"norm{i}", local)
    optimizer = optim.build_optimizer(module, 1e-4, 0.1, 0.9, 0.95, name)
    for param in module.parameters():
        param.grad = torch.randn_like(param)
    optimizer.step()
    count = sum(q.numel() for q in module.parameters())
    return optim.optimizer_state_bytes(optimizer) / count, count


def train_run(name: str, steps: int, out: Path) -> dict[str, float]:
    flags = [*TINY, f"--optimizer={name}", f"--max_steps={steps}", "--validation_batches=4"]
    records = train_subprocess(flags, out / name, {**os.environ, "OMP_NUM_THREADS": "2"})
    train = [r for r in records if r.get("kind") == "train"]
    warm = [r["step_seconds"] for r in train if r["step"] > min(10, steps // 2)]
    val = [r["val_loss"] for r in records if r.get("kind") == "val"]
    times = sorted(warm) or [float("nan")]
    return {
        "train_loss": sum(r["loss"] for r in train[-10:]) / len(train[-10:]),
        "val_loss": val[-1],
        "step_s": times[len(times) // 2],
    }


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=COUNT, default=200)
    parser.add_argument("--ranks", type=COUNT, default=64, help="llama3-70b shard count")
    args = parser.parse_args(argv)

    print("optimizer-state bytes per parameter, counted from the state tensors after one step:")
    print(f"  {'':<10} {'tiny (train.py model)':>22} {f'llama3-70b shard, {args.ranks} ranks':>30}")
    per_gpu = {}
    for name in OPTIMIZERS:
        tiny, _ = tiny_state_bytes(name)
        big, _ = llama70b_shard_bytes(name, args.ranks)
        per_gpu[name] = big * 70.55e9 / args.ranks / 2**30
        print(f"  {name:<10} {tiny:>22.3f} {big:>30.3f}")
    print(
        f"  => llama3-70b on {args.ranks} GPUs, optimizer state per GPU: "
        + ", ".join(f"{n} {g:.2f} GiB" for n, g in per_gpu.items())
    )

    with tempfile.TemporaryDirectory() as tmp:
        results = {name: train_run(name, args.steps, Path(tmp)) for name in OPTIMIZERS}
    base = results["adamw"]
    print(f"\ntrain.py, tiny preset, {args.steps} steps, 1 process (ratio to adamw):")
    for name, r in results.items():
        print(
            f"  {name:<10} train loss (last 10) {r['train_loss']:.4f} "
            f"({r['train_loss'] / base['train_loss'] - 1:+.2%})  "
            f"val loss {r['val_loss']:.4f} ({r['val_loss'] / base['val_loss'] - 1:+.2%})  "
            f"median step {r['step_s'] * 1e3:.0f} ms ({r['step_s'] / base['step_s']:.2f}x)"
        )


if __name__ == "__main__":
    main()
