"""The seed's FP8 matrix on one GPU: training and inference speed of each implementation.

Rows: hf-bf16, te-bf16, te_linear-fp8, te-fp8 for each TE recipe, torchao-fp8 (training), and
hf-bf16, te-bf16, te-fp8 with ``fp8_model_init`` weights (inference). Every row uses the same
Llama shape, batch and data; training rows run forward + backward + AdamW step. One table:
tokens/s/GPU, model TFLOP/s, peak memory, speed-up over hf-bf16 and over te-bf16 (the fair
"FP8 alone" ratio: same TE modules with FP8 off).

    python benchmarks/bench_gpu_matrix.py                     # llama2-7b layer shape, 8 layers
    python benchmarks/bench_gpu_matrix.py --num_layers 32     # the whole 7B (80 GB GPU)

All rows keep fp32 master weights and compute in BF16 (torch.autocast), as train.py does.
Refuses on a machine without a CUDA GPU (exit 2). Rows whose requirements are missing (TE not
installed, recipe not supported by this GPU) are listed as skipped with the reason.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import te_llama  # noqa: E402
from model_utils import te_precision  # noqa: E402

TE_RECIPES = tuple(te_precision.TE_RECIPES)


@dataclass
class Row:
    name: str
    mode: str  # train | infer
    tokens_per_s: float | None = None
    tflops: float | None = None
    peak_gib: float | None = None
    note: str = ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden_width", type=int, default=4096)
    parser.add_argument("--num_layers", type=int, default=8)
    parser.add_argument("--num_heads", type=int, default=32)
    parser.add_argument("--num_key_value_heads", type=int, default=32)
    parser.add_argument("--intermediate_size", type=int, default=11008)
    parser.add_argument("--vocab_size", type=int, default=32000)
    parser.add_argument("--seq_len", type=int, default=4096)
    parser.add_argument("--micro_batch_size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per row")
    parser.add_argument("--te_linear_recipe", default="delayed", choices=TE_RECIPES)
    parser.add_argument("--torchao_recipe", default="tensorwise")
    parser.add_argument("--only", default="", help="comma-separated row names to run")
    return parser.parse_args(argv)


def llama_config(args: argparse.Namespace):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_width,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_key_value_heads,
        max_position_embeddings=args.seq_len,
        use_cache=False,
    )


def flops_per_token(config, seq_len: int) -> float:
    """6 x matmul parameters (input embedding excluded) + attention 12 x L x heads x d x seq."""
    head_dim = config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    per_layer = config.hidden_size * (q + 2 * kv) + q * config.hidden_size
    per_layer += 3 * config.hidden_size * config.intermediate_size
    matmul_params = config.num_hidden_layers * per_layer + config.hidden_size * config.vocab_size
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * head_dim * seq_len
    return 6 * matmul_params + attention


def te_args(fp8: bool, recipe: str, impl: str, fp8_weights: bool = False) -> SimpleNamespace:
    return SimpleNamespace(
        fp8=fp8,
        fp8_recipe=recipe,
        fp8_format="hybrid",
        amax_history_len=1024,
        amax_compute_algo="max",
        fp8_margin=0,
        fp8_weights=fp8_weights,
        model_impl=impl,
    )


def materialise(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    model.to_empty(device="cuda")
    te_llama.init_llama_weights(model, seed=seed)
    return model


def build_hf(config) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    return materialise(model)


def build_te(config, impl: str, backend: te_precision.TEBackend) -> torch.nn.Module:
    with torch.device("meta"):
        model = te_llama.build_te_llama(
            config, impl=impl, fp8_weights=backend.fp8_weights, fp8_recipe=backend.recipe
        )
    return backend.prepare(materialise(model))


def build_torchao(config, recipe: str) -> torch.nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = build_hf(config)

    def keep(module: torch.nn.Module, fqn: str) -> bool:
        dims_ok = module.in_features % 16 == 0 and module.out_features % 16 == 0
        return "lm_head" not in fqn and dims_ok

    convert_to_float8_training(
        model, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=keep
    )
    return model


@contextlib.contextmanager
def bf16_autocast(is_first_microbatch: bool | None = None) -> Iterator[None]:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        yield


def measure(
    step: Callable[[], None], args: argparse.Namespace, tokens_per_step: int
) -> tuple[float, float]:
    """Median tokens/s over timed steps (CUDA-synchronised) and peak memory in GiB."""
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return tokens_per_step / statistics.median(times), torch.cuda.max_memory_allocated() / 2**30


def train_step(model, autocast, input_ids) -> Callable[[], None]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step() -> None:
        with autocast(is_first_microbatch=True):
            loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def infer_step(model, autocast, input_ids) -> Callable[[], None]:
    model.eval()

    def step() -> None:
        with torch.no_grad(), autocast():
            model(input_ids=input_ids)

    return step


def plan(args: argparse.Namespace) -> list[tuple[str, str, Callable]]:
    """(name, mode, factory -> (model, autocast)) for every row of the matrix."""
    config = llama_config(args)

    def te_row(impl: str, fp8: bool, recipe: str, fp8_weights: bool = False):
        def factory():
            backend = te_precision.TEBackend(
                te_args(fp8, recipe, impl, fp8_weights), torch_autocast_dtype=torch.bfloat16
            )
            backend.capability_check()
            return build_te(config, impl, backend), backend.autocast

        return factory

    rows: list[tuple[str, str, Callable]] = [
        ("hf-bf16", "train", lambda: (build_hf(config), bf16_autocast)),
        ("te-bf16", "train", te_row("te", False, "delayed")),
        (
            f"te_linear-fp8-{args.te_linear_recipe}",
            "train",
            te_row("te_linear", True, args.te_linear_recipe),
        ),
    ]
    rows += [(f"te-fp8-{r}", "train", te_row("te", True, r)) for r in TE_RECIPES]
    rows.append(
        (
            f"torchao-fp8-{args.torchao_recipe}",
            "train",
            lambda: (build_torchao(config, args.torchao_recipe), bf16_autocast),
        )
    )
    rows += [
        ("hf-bf16", "infer", lambda: (build_hf(config), bf16_autocast)),
        ("te-bf16", "infer", te_row("te", False, "delayed")),
    ]
    rows += [(f"te-fp8-{r}+fp8_weights", "infer", te_row("te", True, r, True)) for r in TE_RECIPES]
    return rows


def run_row(name: str, mode: str, factory: Callable, args, input_ids, flops: float) -> Row:
    row = Row(name, mode)
    try:
        model, autocast = factory()
        make = train_step if mode == "train" else infer_step
        tokens, peak = measure(make(model, autocast, input_ids), args, input_ids.numel())
        row.tokens_per_s, row.peak_gib = tokens, peak
        row.tflops = tokens * flops / 1e12 / (1 if mode == "train" else 3)  # forward = 1/3
    except (te_precision.TECapabilityError, te_llama.TEUnavailableError, ImportError) as err:
        row.note = f"skipped: {err}"
    except torch.cuda.OutOfMemoryError:
        row.note = "skipped: out of memory (lower --num_layers or --seq_len)"
    return row


def ratio(row: Row, base: Row | None) -> str:
    if not (row.tokens_per_s and base and base.tokens_per_s):
        return "-"
    return f"{row.tokens_per_s / base.tokens_per_s:.2f}x"


def render(rows: list[Row]) -> str:
    header = (
        f"{'mode':<6} {'row':<28} {'tokens/s/GPU':>13} {'TFLOP/s':>8} {'peak GiB':>9} "
        f"{'vs hf-bf16':>10} {'vs te-bf16':>10}  note"
    )
    lines = [header, "-" * len(header)]
    for mode in ("train", "infer"):
        base_hf = next((r for r in rows if r.mode == mode and r.name == "hf-bf16"), None)
        base_te = next((r for r in rows if r.mode == mode and r.name == "te-bf16"), None)
        for row in (r for r in rows if r.mode == mode):
            tokens = f"{row.tokens_per_s:,.0f}" if row.tokens_per_s else "-"
            tflops = f"{row.tflops:.0f}" if row.tflops else "-"
            peak = f"{row.peak_gib:.1f}" if row.peak_gib else "-"
            lines.append(
                f"{mode:<6} {row.name:<28} {tokens:>13} {tflops:>8} {peak:>9} "
                f"{ratio(row, base_hf):>10} {ratio(row, base_te):>10}  {row.note}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "bench_gpu_matrix: needs a CUDA GPU and none is visible; run it on a GPU node "
            "(e.g. inside the image from 0.transformer-engine.dockerfile).",
            file=sys.stderr,
        )
        return 2
    config = llama_config(args)
    problem = te_precision.fp8_shape_problem(
        micro_batch_size=args.micro_batch_size,
        seq_len=args.seq_len,
        hidden_size=args.hidden_width,
        intermediate_size=args.intermediate_size,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_key_value_heads,
    )
    if problem:
        print(f"bench_gpu_matrix: {problem}", file=sys.stderr)
        return 2
    only = {name for name in args.only.split(",") if name}
    torch.manual_seed(0)
    input_ids = torch.randint(
        0, args.vocab_size, (args.micro_batch_size, args.seq_len), device="cuda"
    )
    flops = flops_per_token(config, args.seq_len)
    print(
        f"GPU {torch.cuda.get_device_name()} | shape hidden={args.hidden_width} "
        f"layers={args.num_layers} heads={args.num_heads}/{args.num_key_value_heads} "
        f"ffn={args.intermediate_size} seq={args.seq_len} micro_batch={args.micro_batch_size} | "
        f"TE {'available' if te_llama.te_available() else 'NOT installed'}",
        flush=True,
    )
    rows = []
    for name, mode, factory in plan(args):
        if only and name not in only:
            continue
        rows.append(run_row(name, mode, factory, args, input_ids, flops))
        gc.collect()  # the row's model and optimizer are unreachable now: free their memory
        torch.cuda.empty_cache()
        print(f"  done {mode} {name}", flush=True)
    print(render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
