"""Peak memory of train.py with and without the chunked loss (process max RSS on CPU).

    python -m benchmarks.bench_loss_memory                      # tiny, vocab 65536, seq 1024, mb 8
    python -m benchmarks.bench_loss_memory --vocab_size 8192    # the default vocabulary

Each row is a fresh `train.py` process (default flags otherwise, 3 steps, no checkpoints), so
its peak RSS is the whole run's; the full-logits row holds [tokens, vocab] logits in bf16 and
fp32 plus their gradient, the chunked row one chunk's (model_utils/model/loss.py). Prints the two
peaks and their ratio, measured in one run of this script.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks._common import COUNT, train_subprocess
from model_utils.errors import OneLineParser


def peak_gib(chunked: bool, args: argparse.Namespace, out: Path) -> float:
    flags = ["--preset=tiny", "--model_impl=hf", f"--vocab_size={args.vocab_size}"]
    flags += [f"--max_context_width={args.seq}", f"--train_batch_size={args.micro_batch}"]
    flags += ["--max_steps=3", "--warmup=1", "--validation_batches=1"]
    flags.append(f"--chunked_loss={int(chunked)}")
    records = train_subprocess(flags, out / ("chunked" if chunked else "full"))
    return max(r["peak_mem_gib"] for r in records if r.get("kind") == "train")


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab_size", type=COUNT, default=65536)
    parser.add_argument("--seq", type=COUNT, default=1024)
    parser.add_argument("--micro_batch", type=COUNT, default=8)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        full = peak_gib(False, args, Path(tmp))
        chunked = peak_gib(True, args, Path(tmp))
    logits = args.micro_batch * args.seq * args.vocab_size * 4 / 2**30
    print(
        f"tiny, vocab {args.vocab_size}, seq {args.seq}, micro-batch {args.micro_batch} "
        f"(fp32 logits alone: {logits:.2f} GiB), peak process RSS:"
    )
    print(f"  full logits (HF loss)   {full:6.2f} GiB")
    print(f"  chunked loss            {chunked:6.2f} GiB   ratio {chunked / full:.2f}")


if __name__ == "__main__":
    main()
