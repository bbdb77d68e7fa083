"""What the optimizer side of train.py's step costs: the gradient clip and the AdamW kernel.

    .venv/bin/python -m benchmarks.bench_optim_kernels                    # tiny preset
    .venv/bin/python -m benchmarks.bench_optim_kernels --repeats 50 -- --train_batch_size 4

On the model train.py builds (FSDP2 on a world of one) and the gradients of its real step, the
median wall time of
  clip    step.clip_grad_norm (torch's clip_grad_norm_ on the DTensor gradients), also as a
          share of one whole train_step;
  adamw   torch's AdamW with fused=True (what optim.build_optimizer picks where it exists)
          against foreach=True, on the same parameter groups.
Not a test: timings depend on the machine, which is why optim.py's docstrings name this file
instead of quoting numbers.
"""

from __future__ import annotations

import torch

from benchmarks._common import build_model, median_seconds, options, random_batch
from model_utils import optim
from model_utils.config import arguments
from model_utils.parallel import distributed
from model_utils.run.step import StepParts, clip_grad_norm, train_step


def measure(args: arguments.Config, repeats: int, device: torch.device) -> dict[str, float]:
    model, backend = build_model(args, device)
    optimizer, scheduler = optim.from_config(model, args.optim, args.run.max_steps)
    ids = random_batch(args, device)
    fixed = {"input_ids": ids, "labels": ids}
    parts = StepParts(model, optimizer, scheduler, backend, args, device)

    def step() -> None:
        train_step(parts, lambda: (fixed, 1.0))

    row = {"step": median_seconds(step, repeats, device)}
    with backend.autocast(first_micro_batch=True):
        model(**fixed).loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    saved = [p.grad.detach().clone() for p in params]

    def restore() -> None:
        for param, grad in zip(params, saved, strict=True):
            param.grad = grad.clone()

    row["clip"] = median_seconds(lambda: clip_grad_norm(model, 1.0), repeats, device, restore)
    groups = optim.param_groups(model, args.optim.weight_decay)
    for kind in ("fused", "foreach"):
        try:
            adamw = torch.optim.AdamW(groups, lr=args.optim.lr, **{kind: True})
        except RuntimeError as exc:  # no fused kernel for this device or tensor type
            print(f"adamw {kind}: unavailable here ({exc})")
            continue
        row[f"adamw_{kind}"] = median_seconds(adamw.step, repeats, device, restore)
    return row


def main(argv: list[str] | None = None) -> None:
    p = options(__doc__, repeats=20)
    p.add_argument("--preset", default="tiny")
    opts = p.parse_args(argv)
    args = arguments.parse_args(["--preset", opts.preset, *opts.extra])
    world = distributed.world_from_env()
    if world.world_size > 1:
        raise SystemExit("bench_optim_kernels.py runs one process; start it with python")
    device = distributed.device_for(world)
    distributed.init(world, device, args.parallel.dist_timeout)
    try:
        row = measure(args, opts.repeats, device)
    finally:
        distributed.cleanup()
    ms = {k: v * 1e3 for k, v in row.items()}
    print(f"\n== bench_optim_kernels: --preset {opts.preset} {' '.join(opts.extra)}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {device}")
    print(f"  train_step            {ms['step']:8.1f} ms (median of {opts.repeats})")
    share = 100 * row["clip"] / row["step"]
    print(f"  {'clip_grad_norm':<21} {ms['clip']:8.1f} ms ({share:.0f}% of the step)")
    for kind in ("fused", "foreach"):
        if f"adamw_{kind}" in ms:
            print(f"  AdamW {kind:<15} {ms[f'adamw_{kind}']:8.1f} ms per step")


if __name__ == "__main__":
    main()
