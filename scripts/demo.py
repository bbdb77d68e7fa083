"""`make demo`: train the tiny preset on the bundled corpus without FP8, then with FP8 (emulated
by torchao), and compare.

Each run is the real train.py in its own process, exactly as a user would start it; the table and
the picture at the end are analysis/compare_runs.py's, read back from the two runs' directories.

The two runs compute in bf16 where the CPU has bf16 units (AVX512-BF16 or AMX on x86, BF16 on
Arm), and in fp32 elsewhere: an AVX2-only CPU runs bf16 matmuls 20-60x slower than fp32 ones
(benchmarks/results/, the make-test rounds), which would turn a few minutes into an hour. FP8 is
emulated either way, so the demo shows FP8's numerics against the same model without it.
"""

from __future__ import annotations

import runpy
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__":  # a Python without the environment: one line, exit 2
    runpy.run_path(str(Path(__file__).with_name("environment_check.py")))
from analysis import compare_runs
from model_utils.config.arguments import parse_args
from model_utils.errors import OneLineParser, UsageError, said
from scripts.cpu import cpu_computes_bf16, slow_bf16_line

ROOT = Path(__file__).resolve().parent.parent

#: The demo's runs: the tiny preset at 128-token windows, a size at which both runs end in
#: minutes on two cores (measured: benchmarks/results/, "make demo").
RUN_FLAGS = ("--preset", "tiny", "--max_context_width=128", "--logging_freq=10")

NOTE = """\
FP8 on this machine is emulated: torchao casts to float8 and back around {compute} matmuls, so the
losses show FP8's numerics but the speed is lower than {compute} (extra casts, no FP8 tensor
cores). On H100s the same --fp8=1 flag runs real FP8 GEMMs; README.md shows our H100 figures
(benchmarks/results/ all of them), and benchmarks/bench_gpu_matrix.py produces your own."""


def probe_native_bf16(size: int = 256, repeats: int = 20) -> bool:
    """Where there is no /proc/cpuinfo: bf16 matmuls at most 2x the time of fp32 ones (a CPU
    without bf16 units is 10x slower or more, so the probe's noise does not decide it)."""
    import torch

    def seconds(dtype: torch.dtype) -> float:
        a = torch.randn(size, size).to(dtype)
        a @ a  # warm-up
        start = time.perf_counter()
        for _ in range(repeats):
            a @ a
        return time.perf_counter() - start

    return seconds(torch.bfloat16) <= 2 * seconds(torch.float32)


def computes_bf16() -> bool:
    """The CPU's flags where Linux lists them, else the probe."""
    native = cpu_computes_bf16()
    return probe_native_bf16() if native is None else native


@dataclass(frozen=True)
class Demo:
    """What the demo runs on this CPU: the compute dtype, the flags it adds, the labels."""

    compute: str  # "bf16" or "fp32"

    @property
    def flags(self) -> list[str]:
        return [] if self.compute == "bf16" else ["--bf16=0"]

    @property
    def labels(self) -> str:
        return f"{self.compute},fp8 (emulated in {self.compute})"

    @property
    def title(self) -> str:
        return (
            f"CPU demo (make demo): tiny Llama, {self.compute} compute; FP8 emulated by torchao: "
            "its losses, not its speed"
        )

    def line(self) -> str:
        if self.compute == "bf16":
            return "make demo: this CPU has bf16 units: both runs compute in bf16"
        return f"make demo: {slow_bf16_line()}: both runs compute in fp32, FP8 still emulated"


#: Written into each run folder the demo makes: the next demo removes only a folder holding it,
#: never one a user had at --out/NAME.
MARK = ".made_by_make_demo"


def train_command(fp8: bool, steps: int, run_dir: Path, extra: list[str]) -> list[str]:
    flags = [f"--max_steps={steps}", f"--fp8={int(fp8)}", f"--validation_freq={steps}"]
    flags += [f"--output_dir={run_dir}", *extra]
    return [sys.executable, str(ROOT / "train.py"), *RUN_FLAGS, *flags]


def problem(run_dir: Path, cmd: list[str]) -> str | None:
    """Why the run cannot start, before anything is removed: its flags (train.py's check), or
    a file or a folder the demo did not make at `run_dir` (it starts each run afresh)."""
    try:
        parse_args(cmd[2:])
    except UsageError as exc:
        return str(exc)
    empty = run_dir.is_dir() and not any(run_dir.iterdir())
    if run_dir.exists() and not empty and not (run_dir / MARK).is_file():
        return f"--out: {run_dir} holds what the demo did not write: move it or pick another --out"
    return None


def run(run_dir: Path, cmd: list[str]) -> Path:
    """One run in a fresh folder (an earlier demo's removed), as a user would start it; a run
    that fails has said why in its own line, and the demo exits with its code."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    (run_dir / MARK).touch()
    print(f"\n$ {' '.join(cmd[1:])}", flush=True)
    if code := subprocess.run(cmd, cwd=ROOT).returncode:
        sys.exit(code)
    return run_dir


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "demo")
    parser.add_argument(
        "--compute",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help="auto: bf16 where the CPU has bf16 units, else fp32",
    )
    known, extra = parser.parse_known_args(argv)
    known.out = known.out.expanduser().absolute()  # the runs train from the checkout (cwd=ROOT)
    demo = Demo(known.compute if known.compute != "auto" else "bf16" if computes_bf16() else "fp32")
    commands = {
        known.out / name: train_command(fp8, known.steps, known.out / name, [*demo.flags, *extra])
        for name, fp8 in ((demo.compute, False), ("fp8", True))
    }
    for run_dir, cmd in commands.items():
        if found := problem(run_dir, cmd):
            sys.exit(said("demo.py", found))
    print(demo.line(), flush=True)
    print("make demo: each run's log says how long it has left, measured as it trains", flush=True)
    started = time.monotonic()
    plain, fp8 = (run(run_dir, cmd) for run_dir, cmd in commands.items())
    print(f"\n=== tiny Llama, bundled corpus: --fp8=0 vs --fp8=1, {demo.compute} compute ===")
    png = known.out / "compare.png"
    pair = compare_runs.Options([plain, fp8], png, demo.labels, title=demo.title)
    if compare_runs.main(options=pair):
        sys.exit(2)
    print("\n" + NOTE.format(compute=demo.compute))
    print(f"\nPicture of the two runs: {png}")
    print(f"make demo: both runs took {time.monotonic() - started:.0f} s on this machine")


if __name__ == "__main__":
    main()
