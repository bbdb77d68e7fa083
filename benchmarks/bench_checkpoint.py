"""Checkpoint save/load time versus state size (model + AdamW state + schedule + data + RNG).

    .venv/bin/python -m benchmarks.bench_checkpoint                          # 1 process
    .venv/bin/torchrun --nproc_per_node=2 benchmarks/bench_checkpoint.py     # 2 ranks (gloo)
    .venv/bin/python -m benchmarks.bench_checkpoint --sizes 256x4,1024x8 --dir /fast/disk/tmp

For each model shape (hidden x layers, Llama proportions, built by the training code itself:
meta device -> FSDP2 -> materialise), one training step creates the AdamW state, then it measures
  save      blocking `Checkpointer.save` (DCP write + atomic publish), seconds and MB/s
  async     time until `save(async)` returns (staging to CPU), then until it is published
  load      `Checkpointer.load` into the same objects (DCP read + set_state_dict)
  export    `export_hf` (gather to rank 0 + safetensors, fp32)
State size is what lands on disk (fp32 master weights + 2 AdamW moments ~ 12 bytes/param).
The page cache makes a second read of a fresh file fast: these are upper bounds for a local disk.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import train
from benchmarks._common import FOLDER, SHAPES, random_batch
from model_utils import checkpoint, data, optim
from model_utils.checkpoint.manifest import dir_bytes
from model_utils.config import arguments
from model_utils.config.presets import BUNDLED_TOKENIZER
from model_utils.errors import OneLineParser
from model_utils.model import modeling
from model_utils.parallel import distributed
from model_utils.precision import backends as precision


def shape_flags(spec: str) -> list[str]:
    """'1024x8' -> Llama-proportioned flags: head dim 64, GQA 2:1, FFN ~8/3 hidden (x16)."""
    hidden, layers = (int(x) for x in spec.split("x"))
    heads, ffn = max(1, hidden // 64), (hidden * 8 // 3 + 15) // 16 * 16
    shape = f"--hidden_width {hidden} --num_layers {layers} --num_heads {heads} "
    return (shape + f"--num_key_value_heads {max(1, heads // 2)} --intermediate_size {ffn}").split()


class Bench:
    def __init__(self, spec: str, mesh: object, device: torch.device) -> None:
        run = "--train_batch_size 1 --max_context_width 64 --max_steps 10 --warmup 1"
        argv = ["--preset", "tiny", *shape_flags(spec), *run.split()]
        args = arguments.parse_args(argv)
        self.backend = precision.build_backend(args, device)
        self.model = train.build_model(args, mesh, device, self.backend)
        self.params = modeling.count_parameters(self.model)
        self.optimizer, self.scheduler = optim.from_config(self.model, args.optim, 10)
        ids = random_batch(args, device)
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state = checkpoint.TrainState(
            self.model, self.optimizer, self.scheduler, config=args.as_dict(), step=1
        )


def timed(fn) -> tuple[float, object]:
    dist.barrier()
    start = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - start, out


def measure(spec: str, root: Path, mesh: object, device: torch.device) -> dict[str, float]:
    bench = Bench(spec, mesh, device)
    sync = checkpoint.Checkpointer(root / f"{spec}-sync", keep_last=1)
    save_s, path = timed(lambda: sync.save(1, bench.state))
    size_mb = dir_bytes(path) / 2**20
    load_s, _ = timed(lambda: sync.load(path, bench.state))
    asyncer = checkpoint.Checkpointer(root / f"{spec}-async", keep_last=1, async_save=True)
    async_return_s, _ = timed(lambda: asyncer.save(2, bench.state))
    async_total_s, _ = timed(asyncer.wait)
    tokenizer = data.load_tokenizer(BUNDLED_TOKENIZER)
    export_s, _ = timed(
        lambda: checkpoint.export_hf(bench.model, bench.model.config, root / "hf", tokenizer)
    )
    return {
        "params_m": bench.params / 1e6,
        "size_mb": size_mb,
        "save_s": save_s,
        "save_mb_s": size_mb / save_s,
        "load_s": load_s,
        "load_mb_s": size_mb / load_s,
        "async_return_s": async_return_s,
        "async_published_s": async_return_s + async_total_s,
        "export_s": export_s,
    }


def main() -> None:
    p = OneLineParser(description="checkpoint save/load time vs state size")
    p.add_argument("--sizes", default="256x4,512x8,1024x8", type=SHAPES, help="hidden x layers")
    p.add_argument("--dir", type=FOLDER, help="where to write (default: a temp dir, removed)")
    cli = p.parse_args()
    world = distributed.world_from_env()
    device = distributed.device_for(world)
    distributed.init(world, device, 600)
    mesh = distributed.build_mesh(world, device, "full")
    # Every rank must write into the same directory: rank 0 picks it, the others receive it.
    picked = [cli.dir or (tempfile.mkdtemp(prefix="bench_ckpt_") if world.rank == 0 else None)]
    dist.broadcast_object_list(picked, src=0)
    root = Path(picked[0])
    rows = []
    try:
        for spec in cli.sizes.split(","):
            rows.append((spec, measure(spec, root / "run", mesh, device)))
            if world.rank == 0:
                shutil.rmtree(root / "run", ignore_errors=True)
            dist.barrier()
    finally:
        if world.rank == 0 and cli.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    if world.rank == 0:
        print(f"\ncommand: {' '.join(sys.argv)}  (world size {world.world_size}, {device})")
        head = (
            f"{'shape':>9} {'params':>8} {'state':>9} {'save':>7} {'save':>8} {'load':>7} "
            f"{'load':>8} {'async':>7} {'async':>9} {'export':>7}"
        )
        unit = (
            f"{'':>9} {'M':>8} {'MB':>9} {'s':>7} {'MB/s':>8} {'s':>7} {'MB/s':>8} "
            f"{'ret. s':>7} {'publ. s':>9} {'s':>7}"
        )
        print(head)
        print(unit)
        for spec, r in rows:
            print(
                f"{spec:>9} {r['params_m']:8.1f} {r['size_mb']:9.1f} {r['save_s']:7.2f} "
                f"{r['save_mb_s']:8.0f} {r['load_s']:7.2f} {r['load_mb_s']:8.0f} "
                f"{r['async_return_s']:7.2f} {r['async_published_s']:9.2f} {r['export_s']:7.2f}"
            )
    distributed.cleanup()


if __name__ == "__main__":
    main()
