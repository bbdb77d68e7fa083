"""`make demo`: train the tiny preset on the bundled corpus in BF16, then in FP8, and compare.

Each run is the real train.py in its own process, exactly as a user would start it; the table and
the picture at the end are scripts/compare_runs.py's, read back from the two runs' directories.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from scripts import compare_runs

ROOT = Path(__file__).resolve().parent.parent


NOTE = """\
FP8 on this machine is emulated: torchao casts to float8 and back around bf16 matmuls, so the
losses show FP8's numerics but the speed is lower than bf16 (extra casts, no FP8 tensor cores).
On H100s the same --fp8=1 flag runs real FP8 GEMMs; README.md shows our H100 figures
(benchmarks/results/ all of them), and benchmarks/bench_gpu_matrix.py produces your own."""
TITLE = (
    "CPU demo (make demo): tiny Llama, 2 cores; FP8 emulated by torchao: its losses, not its speed"
)


def run(precision: str, steps: int, out: Path, extra: list[str]) -> Path:
    run_dir = out / precision
    shutil.rmtree(run_dir, ignore_errors=True)  # a demo always starts fresh
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        "--preset",
        "tiny",
        f"--max_steps={steps}",
        f"--fp8={int(precision == 'fp8')}",
        "--logging_freq=10",
        "--validation_freq=50",
        f"--output_dir={run_dir}",
        *extra,
    ]
    print(f"\n$ {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    return run_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "demo")
    known, extra = parser.parse_known_args()
    bf16 = run("bf16", known.steps, known.out, extra)
    fp8 = run("fp8", known.steps, known.out, extra)
    print("\n=== tiny Llama, bundled corpus: --fp8=0 vs --fp8=1 ===")
    png = known.out / "compare.png"
    argv = [
        str(bf16),
        str(fp8),
        f"--output={png}",
        "--labels=bf16,fp8 (emulated)",
        f"--title={TITLE}",
    ]
    if compare_runs.main(argv):
        sys.exit(2)
    print("\n" + NOTE)
    print(f"\nPicture of the two runs: {png}")


if __name__ == "__main__":
    main()
