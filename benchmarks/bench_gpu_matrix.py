"""The seed's FP8 matrix on a GPU node: what each implementation and precision buys.

Training rows run the real recipe (`torchrun train.py`, FSDP2, the same preset, batch and data)
and read each run's metrics.jsonl summary; inference rows time forward passes of the model
train.py builds, with Transformer Engine's FP8-only weights (`--fp8_weights`, fp8_model_init).

    python -m benchmarks.bench_gpu_matrix --preset llama3-8b --nproc 8
    python -m benchmarks.bench_gpu_matrix --preset llama2-7b --nproc 8 -- --max_context_width 4096

Rows: hf-bf16, te-bf16, te_linear-fp8, te-fp8 per TE recipe, torchao-fp8 (tensorwise with float8
all-gather, rowwise). Columns: tokens/s/GPU, TFLOP/s/GPU, peak memory, speed-up over hf-bf16 and
over te-bf16 (the fair "FP8 alone" ratio: same TE model with FP8 off). A row whose recipe the GPU
or TE cannot run is listed with train.py's one-line reason. Refuses without a CUDA GPU (exit 2).

`--modes levers` runs issue 12's speed and memory levers (micro-batch, loss, compile, master
weights, resharding, AC, FP8 attention, torchao); `--only` picks rows and `--vs ROW` compares
every row with one of them, measured in the same run:

    python -m benchmarks.bench_gpu_matrix --preset llama3-8b --nproc 1 --modes levers \
        --only "te-bf16 mb2,te-fp8 mb2" --vs "te-bf16 mb2" -- --num_layers 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks._common import COUNT, ROOT
from model_utils.config.options import TE_RECIPES
from model_utils.errors import OneLineParser, said
from model_utils.report import metrics

# (row name, train.py flags). Every row shares the preset, batch, steps and data. torchao's
# float8 needs torch.compile to fuse its casts (torchtitan requires it), so its rows and their
# bf16 baseline compile; TE rows run TE's fused kernels eagerly.
TRAIN_ROWS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("hf-bf16", ("--model_impl=hf", "--fp8=0")),
    ("hf-bf16+compile", ("--model_impl=hf", "--fp8=0", "--compile")),
    ("te-bf16", ("--model_impl=te", "--fp8=0")),
    ("te_linear-fp8-delayed", ("--model_impl=te_linear", "--fp8=1", "--fp8_recipe=delayed")),
    *((f"te-fp8-{r}", ("--model_impl=te", "--fp8=1", f"--fp8_recipe={r}")) for r in TE_RECIPES),
    (
        "torchao-fp8-tensorwise+ag+compile",
        ("--model_impl=hf", "--fp8=1", "--fp8_all_gather", "--compile"),
    ),
    (
        "torchao-fp8-rowwise+compile",
        ("--model_impl=hf", "--fp8=1", "--fp8_recipe=rowwise", "--compile"),
    ),
)
#: Issue 12's speed and memory levers on the fastest TE recipe, one at a time. A row's name is
#: its flags: model and precision, micro-batch (``mbN``), then its levers (LEVER_WORDS), so one
#: command reproduces the whole table (the rows' flags come after the user's); the ``hf-loss``
#: rows are the baseline (transformers' full fp32 logits).
EXPANDABLE = {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
TE_FP8 = ("--model_impl=te", "--fp8=1", "--fp8_recipe=delayed")
LEVER_WORDS: dict[str, tuple[str, ...]] = {
    "te-bf16": ("--model_impl=te", "--fp8=0"),
    "te-fp8": TE_FP8,
    "torchao-fp8": ("--model_impl=hf", "--fp8=1"),
    "hf-loss": ("--chunked_loss=0",),
    "+compile": ("--compile",),
    "+masters": ("--master_weights=optimizer",),
    "+fp8-weights": ("--fp8_weights",),
    "+no-reshard": ("--reshard_after_forward=never",),
    "+ag": ("--fp8_all_gather",),
    "+fp8-attention": ("--fp8_attention",),
    "+AC": ("--activation_checkpointing",),
    "+AC/2": ("--activation_checkpointing", "--ac_every=2"),
    "+AC-mlp": ("--activation_checkpointing", "--ac_scope=mlp"),
    "+expandable": (),  # the allocator's setting: EXPANDABLE
}
LEVERS = (
    "te-bf16 mb2 hf-loss",
    "te-bf16 mb2",
    "te-fp8 mb2 hf-loss",
    "te-fp8 mb2",
    "te-fp8 mb2 +compile",
    "te-fp8 mb3",
    "te-fp8 mb3 +expandable",
    "te-bf16 mb4 +expandable",
    "te-fp8 mb4 +expandable",
    "te-bf16 mb4 +masters +expandable",
    "te-fp8 mb4 +masters +expandable",
    "te-fp8 mb4 +fp8-weights +masters +expandable",
    "te-fp8 mb4 +no-reshard +expandable",
    "te-fp8 mb4 +compile +expandable",
    # torchao's float8 (tensorwise, float8 all-gather) under the same levers as the fastest TE
    # row: the two FP8 paths compared where each is at its best.
    "torchao-fp8 mb4 +ag +compile +expandable",
    # The levers that changed no loss beyond run-to-run noise, together, on each precision:
    # FP8's speed-up measured with the same levers on both sides.
    "te-bf16 mb4 +compile +masters +no-reshard +expandable",
    "te-fp8 mb4 +compile +masters +no-reshard +expandable",
    "te-fp8 mb4 +fp8-attention +expandable",
    "te-fp8 mb4 +AC/2 +expandable",
    "te-fp8 mb4 +AC +expandable",
    "te-fp8 mb4 +AC-mlp +expandable",
    "te-fp8 mb6 +AC-mlp +expandable",
)


def lever_row(name: str) -> tuple[str, tuple[str, ...], dict[str, str]]:
    """(name, train.py flags, environment) of the lever row ``name``, read word by word."""
    flags: list[str] = []
    for word in name.split():
        flags += [f"--train_batch_size={word[2:]}"] if word.startswith("mb") else LEVER_WORDS[word]
    return name, tuple(flags), EXPANDABLE if "+expandable" in name.split() else {}


LEVER_ROWS = tuple(lever_row(name) for name in LEVERS)
INFER_ROWS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("hf-bf16", ("--model_impl=hf", "--fp8=0")),
    ("te-bf16", ("--model_impl=te", "--fp8=0")),
    *(
        (
            f"te-fp8-{r}+fp8_weights",
            ("--model_impl=te", "--fp8=1", f"--fp8_recipe={r}", "--fp8_weights"),
        )
        for r in TE_RECIPES
    ),
)
#: Known failure signatures -> what to do (the cause line itself is printed too).
HINTS: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        ("libcudnn", "undefined symbol"),
        "a system cuDNN shadows the one torch was built with: drop its directory from "
        "LD_LIBRARY_PATH (or run inside the image from 0.transformer-engine.dockerfile)",
    ),
    (("out of memory",), "lower --train_batch_size or add --activation_checkpointing"),
    (("needs SM", "needs Transformer Engine", "Blackwell"), "this GPU or TE cannot run the row"),
)


#: Steps left out of every median (allocator growth, autotuning, compilation).
WARMUP_STEPS = 5


@dataclass
class Row:
    name: str
    mode: str  # train | infer
    tokens_per_s: float | None = None
    tflops: float | None = None
    peak_gib: float | None = None
    wall_tokens_per_s: float | None = None  # from record timestamps: a check on tokens_per_s
    note: str = ""


def failure_note(output: str) -> str:
    """The cause of a failed row (its last error line) and what to do, on one line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    usage = [ln for ln in lines if ln.startswith("train.py: error:")]  # train.py's one line
    errors = usage or [ln for ln in lines if "Error" in ln and "elastic" not in ln] or lines[-1:]
    cause = errors[-1][:240] if errors else "failed without output"
    hint = next((h for keys, h in HINTS if any(k in output for k in keys)), "see the row's log")
    return f"failed: {cause} -> {hint}"


def wall_clock_rate(records: list[dict], warmup_steps: int) -> float | None:
    """Tokens per second per device between the first and last logged step after warm-up,
    from the records' wall-clock timestamps alone."""
    train = [r for r in records if r.get("kind") == "train" and r["step"] > warmup_steps]
    if len(train) < 2:
        return None
    tokens = sum(r["tokens"] for r in train[1:])
    devices = (
        train[-1]["tokens"] / train[-1]["tokens_per_sec_per_device"] / train[-1]["step_seconds"]
    )
    return tokens / (train[-1]["time"] - train[0]["time"]) / devices


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama2-7b")
    parser.add_argument("--nproc", type=COUNT, help="GPUs (default: all visible)")
    parser.add_argument("--max_steps", type=COUNT, default=40, help="training steps per row")
    parser.add_argument("--infer_steps", type=COUNT, default=20, help="timed forwards per row")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu_matrix")
    parser.add_argument("--only", default="", help="comma-separated row names")
    parser.add_argument(
        "--modes",
        default="train,infer",
        help="comma-separated: train (the matrix), levers (issue 12's rows), infer",
    )
    parser.add_argument(
        "--vs",
        default="",
        help="a row every row of its mode is compared with in column A (e.g. te-bf16 against "
        "te-fp8 on one slice); default: the mode's own baseline",
    )
    args, extra = parser.parse_known_args(argv)
    for problem in selection_problems(args.modes, args.only, args.vs):
        parser.error(problem)  # one line, exit 2, before any GPU work
    return args, [a for a in extra if a != "--"]


MODES: dict[str, tuple[str, ...]] = {
    "train": tuple(name for name, _ in TRAIN_ROWS),
    "levers": tuple(name for name, *_ in LEVER_ROWS),
    "infer": tuple(name for name, _ in INFER_ROWS),
}


def selection_problems(modes: str, only: str, vs: str = "") -> list[str]:
    """What is wrong with ``--modes``/``--only``/``--vs``: a misspelt row name would otherwise
    run nothing and spend a GPU call on an empty table, or print a table without its ratio."""
    chosen = [m for m in modes.split(",") if m]
    problems = [
        f"--modes: unknown mode {m!r}; choose from {', '.join(MODES)}"
        for m in chosen
        if m not in MODES
    ]
    known = {name for m in chosen if m in MODES for name in MODES[m]}
    for name in (n for n in only.split(",") if n):
        if name not in known:
            problems.append(
                f"--only: no row {name!r} in --modes {modes} "
                f"(rows: {'; '.join(sorted(known)) or 'none'})"
            )
    selected = [n for n in only.split(",") if n] or known
    if vs and vs not in selected:
        problems.append(f"--vs: {vs!r} is not among the rows that run; add it to --only")
    return problems


def train_command(
    args: argparse.Namespace,
    name: str,
    flags: tuple[str, ...],
    extra: list[str],
    fixed: tuple[str, ...] = (),
) -> list[str]:
    """The torchrun command of one training row (no checkpoints: only speed is measured).

    The user's flags override the row's ``flags`` but not its ``fixed`` ones (a lever row's
    micro-batch is the point of the row).
    """
    torchrun = f"-m torch.distributed.run --standalone --nproc_per_node={args.nproc}"
    steps = args.max_steps
    run = f"--preset={args.preset} --max_steps={steps} --warmup={max(1, steps // 10)}"
    run += " --checkpoint_freq=-1 --validation_batches=1 --logging_freq=1"
    head = [sys.executable, *torchrun.split(), str(ROOT / "train.py"), *run.split()]
    return [*head, f"--output_dir={args.out / name.replace(' ', '_')}", *flags, *extra, *fixed]


def train_row(
    args,
    name: str,
    flags: tuple[str, ...],
    extra: list[str],
    fixed: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    mode: str = "train",
) -> Row:
    run_dir = args.out / name.replace(" ", "_")
    command = train_command(args, name, flags, extra, fixed)
    environ = {**os.environ, **(env or {})}
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=environ)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "log.txt").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        return Row(name, mode, note=failure_note(result.stdout + result.stderr))
    records = metrics.read_jsonl(run_dir / "metrics.jsonl")
    summary = metrics.summarize(records, warmup_steps=WARMUP_STEPS)
    keys = ("tokens_per_sec_per_device", "tflops_per_device", "peak_mem_gib")  # Row's order
    return Row(name, mode, *(summary[k] for k in keys), wall_clock_rate(records, WARMUP_STEPS))


def infer_row(args, name: str, flags: tuple[str, ...], extra: list[str]) -> Row:
    """Forward-only throughput of the model train.py builds (one GPU, a world of one)."""
    import train

    argv = [f"--preset={args.preset}", "--max_steps=20", *flags, *extra]
    try:
        train_args, _ = train.validate(argv, training=False)
    except Exception as exc:  # UsageError / capability errors: the row's reason
        return Row(name, "infer", note=f"skipped: {exc}")
    try:
        return _timed_forwards(args, name, train_args)
    except Exception as exc:  # e.g. a cuDNN symbol error: say what failed and what to do
        torch.cuda.empty_cache()
        return Row(name, "infer", note=failure_note(f"{type(exc).__name__}: {exc}"))


def _timed_forwards(args, name: str, train_args) -> Row:
    import torch.distributed as dist

    from benchmarks._common import build_model, random_batch
    from model_utils.parallel import distributed

    device = torch.device("cuda", 0)
    if not dist.is_initialized():
        distributed.init(distributed.world_from_env({}), device, train_args.parallel.dist_timeout)
    model, backend = build_model(train_args, device)
    model.eval()
    batch = random_batch(train_args, device)
    torch.cuda.reset_peak_memory_stats()
    times = []
    with torch.no_grad():
        for i in range(args.infer_steps + 3):
            start = time.perf_counter()
            with backend.autocast():
                model(input_ids=batch)
            torch.cuda.synchronize()
            if i >= 3:
                times.append(time.perf_counter() - start)
    tokens_per_s = batch.numel() / statistics.median(times)
    flops = metrics.flops_per_token(train_args.model, train_args.model.max_context_width)
    peak = torch.cuda.max_memory_allocated() / 2**30
    del model
    torch.cuda.empty_cache()
    return Row(name, "infer", tokens_per_s, tokens_per_s * flops / 3 / 1e12, peak)


def ratio(row: Row, base: Row | None) -> str:
    if not (row.tokens_per_s and base and base.tokens_per_s):
        return "-"
    return f"{row.tokens_per_s / base.tokens_per_s:.2f}x"


#: Each mode's two ratio baselines (columns "vs A" and "vs B").
BASELINES = {
    "train": ("hf-bf16", "te-bf16"),
    "levers": ("te-fp8 mb2 hf-loss", "te-bf16 mb2 hf-loss"),
    "infer": ("hf-bf16", "te-bf16"),
}


def baselines_with(vs: str) -> dict[str, tuple[str, str]]:
    """The ratio baselines, with ``--vs`` as column A of the mode holding that row."""
    if not vs:
        return dict(BASELINES)
    return {mode: (vs, b) if vs in MODES[mode] else (a, b) for mode, (a, b) in BASELINES.items()}


def render(rows: list[Row], shape: str = "", baselines: dict | None = None) -> str:
    header = (
        f"{'mode':<6} {'row':<34} {'tokens/s/GPU':>13} {'wall tok/s':>11} {'TFLOP/s':>8} "
        f"{'peak GiB':>9} {'vs A':>6} {'vs B':>6}  note"
    )
    lines = [shape, header, "-" * len(header)] if shape else [header, "-" * len(header)]
    for mode, (a, b) in (baselines or BASELINES).items():
        mode_rows = [r for r in rows if r.mode == mode]
        if not mode_rows:
            continue
        base_a = next((r for r in mode_rows if r.name == a), None)
        base_b = next((r for r in mode_rows if r.name == b), None)
        lines.append(f"[{mode}] A = {a}, B = {b}")
        for row in mode_rows:
            tokens = f"{row.tokens_per_s:,.0f}" if row.tokens_per_s else "-"
            wall = f"{row.wall_tokens_per_s:,.0f}" if row.wall_tokens_per_s else "-"
            tflops = f"{row.tflops:.0f}" if row.tflops else "-"
            peak = f"{row.peak_gib:.1f}" if row.peak_gib else "-"
            lines.append(
                f"{mode:<6} {row.name:<34} {tokens:>13} {wall:>11} {tflops:>8} {peak:>9} "
                f"{ratio(row, base_a):>6} {ratio(row, base_b):>6}  {row.note}"
            )
    return "\n".join(lines)


def shape_line(args, row_flags: list[str], per_row_batch: bool) -> str:
    """What every row ran: preset, sequence length, micro-batch, steps, GPUs.

    Parsed from the first row's own flags (the user's alone may not parse: ``--fp8_attention``
    is refused without the ``--fp8=1`` a row supplies). Lever rows fix their own micro-batch.
    """
    from model_utils.config.arguments import parse_args as train_parse_args

    shaped = train_parse_args([f"--preset={args.preset}", *row_flags])
    shape, data = shaped.model, shaped.data
    batch = (
        "micro-batch per row"
        if per_row_batch
        else f"micro-batch {data.train_batch_size} x {shaped.optim.grad_accum_steps} accumulation"
    )
    return (
        f"preset {args.preset} ({shape.num_layers} layers, hidden {shape.hidden_width}, "
        f"vocab {shape.vocab_size}), seq {shape.max_context_width}, {batch}, {args.max_steps} "
        f"steps (medians after step {WARMUP_STEPS}), {args.nproc} GPU(s)"
    )


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    only = {n for n in args.only.split(",") if n}
    planned = [
        *(("train", name, flags, (), {}) for name, flags in TRAIN_ROWS),
        *(("levers", name, (), fixed, env) for name, fixed, env in LEVER_ROWS),
        *(("infer", name, flags, (), {}) for name, flags in INFER_ROWS),
    ]
    planned = [p for p in planned if p[0] in args.modes.split(",") and (not only or p[1] in only)]
    for mode, name, *_ in planned:  # a row is never measured again over a kept one
        if (
            mode != "infer"
            and (held := args.out / name.replace(" ", "_") / "metrics.jsonl").exists()
        ):
            return said(
                "bench_gpu_matrix.py", f"{held.parent} holds a run already: give a new --out"
            )
    if not torch.cuda.is_available():
        return said(
            "bench_gpu_matrix.py",
            "needs a CUDA GPU and none is visible; run it on a GPU node "
            "(e.g. inside the image from 0.transformer-engine.dockerfile).",
        )
    args.nproc = args.nproc or torch.cuda.device_count()
    print(f"{torch.cuda.get_device_name()} x {args.nproc}, preset {args.preset}", flush=True)
    rows = []
    ran: list[list[str]] = []  # each row's train.py flags, for the shape line
    for mode, name, flags, fixed, env in planned:
        if mode == "infer":
            rows.append(infer_row(args, name, flags, extra))
        else:
            rows.append(train_row(args, name, flags, extra, fixed, env, mode))
        ran.append([*flags, *extra, *fixed])  # a lever row's flags are all fixed
        print(f"  done {mode} {name}", flush=True)
    levers_ran = any(row.mode == "levers" for row in rows)
    shape = shape_line(args, ran[0] if ran else extra, levers_ran)
    print(render(rows, shape, baselines_with(args.vs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
