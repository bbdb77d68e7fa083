"""What --master_weights optimizer holds and costs beside the default, on this machine.

    python -m benchmarks.bench_master_weights                 # tiny, 30 steps per setting
    python -m benchmarks.bench_master_weights --steps 60 -- --num_layers 8

For each --master_weights setting, on the model train.py builds (FSDP2, a world of one, CPU):
1. bytes per parameter that training holds between steps, counted from the tensors after a step:
   the parameter shards, their gradients (set to None after each step, so counted before the
   optimizer step) and the optimizer state (optim.optimizer_state_bytes);
2. the median time of train.py's step (model_utils.run.step.train_step) after warm-up, and the
   loss after `--steps` steps on the same data.
On a CPU the step time says how the two optimizers compare in torch ops here, not what the
H100 does (there TE's FusedAdam runs, and FSDP2's fp32 -> bf16 cast of every gathered unit is
what the setting removes): the GPU figure is benchmarks/gpu_levers.sh's `masters` phase.
"""

from __future__ import annotations

import statistics
import time

from benchmarks._common import options

SETTINGS = ("params", "optimizer")
TINY = ["--preset=tiny", "--train_batch_size=4", "--max_context_width=128", "--warmup=2"]


def measure(setting: str, steps: int, extra: list[str]) -> dict[str, float]:
    import torch

    import train
    from benchmarks._common import build_model, random_batch, world_of_one
    from model_utils import optim
    from model_utils.config.arguments import parse_args
    from model_utils.run.step import StepParts, train_step

    device = torch.device("cpu")
    world_of_one(device)
    args = parse_args([*TINY, f"--max_steps={steps}", f"--master_weights={setting}", *extra])
    torch.manual_seed(args.run.seed)
    model, backend = build_model(args, device)
    optimizer, scheduler = train.build_optimizer(model, args, device, backend)
    gen = torch.Generator().manual_seed(0)
    batches = [random_batch(args, device, gen) for _ in range(4)]
    held: dict[str, int] = {}

    def count_before_step(*_: object) -> None:
        params = list(model.parameters())
        held["params"] = sum(optim.local_bytes(p) for p in params)
        held["grads"] = sum(optim.local_bytes(p.grad) for p in params if p.grad is not None)

    optimizer.register_step_pre_hook(count_before_step)
    times, loss = [], float("nan")
    for step in range(steps):
        batch = {"input_ids": batches[step % len(batches)], "labels": batches[step % len(batches)]}
        start = time.perf_counter()
        parts = StepParts(model, optimizer, scheduler, backend, args, device)
        done = train_step(parts, lambda b=batch: (b, 1.0))
        loss = done.loss.item()
        times.append(time.perf_counter() - start)
    num = sum(p.numel() for p in model.parameters())
    state = optim.optimizer_state_bytes(optimizer)
    warm = times[min(5, steps - 1) :]
    return {
        "params_bytes": held["params"] / num,
        "grads_bytes": held["grads"] / num,
        "state_bytes": state / num,
        "total_bytes": (held["params"] + held["grads"] + state) / num,
        "step_s": statistics.median(warm),
        "loss": loss,
        "optimizer": optim.describe(optimizer),
    }


def main(argv: list[str] | None = None) -> None:
    parser = options(__doc__, steps=30)
    cli = parser.parse_args(argv)
    if cli.steps < 6:
        parser.error("--steps must be >= 6 (5 warm-up steps are left out of the median)")
    results = {setting: measure(setting, cli.steps, cli.extra) for setting in SETTINGS}
    base = results["params"]
    print(f"--master_weights on the tiny model as train.py builds it (CPU), {cli.steps} steps")
    print(
        "| setting | params | grads | optimizer state | bytes/param held | step vs params | loss |"
    )
    print("|---|---|---|---|---|---|---|")
    for setting, r in results.items():
        print(
            f"| {setting} | {r['params_bytes']:.2f} | {r['grads_bytes']:.2f} "
            f"| {r['state_bytes']:.2f} | {r['total_bytes']:.2f} "
            f"| {r['step_s'] / base['step_s']:.2f}x | {r['loss']:.5f} |"
        )
    for setting, r in results.items():
        print(f"{setting}: {r['optimizer']}, median step {r['step_s'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
