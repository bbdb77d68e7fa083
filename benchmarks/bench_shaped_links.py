"""Benchmark: analysis.project_scale against a real two-node cluster whose link is shaped.

    sudo .venv/bin/python -m benchmarks.bench_shaped_links                 # off,1gbit,200mbit
    sudo .venv/bin/python -m benchmarks.bench_shaped_links --rates off,100mbit --steps 16

The two-node Slurm cluster of tools/slurm_cluster.sh (a namespace, address and slurmd per node;
one gloo rank per node, full sharding across the two), and 1.train_llama.sbatch as a user runs
it. At each rate both nodes' sending is capped (`slurm_cluster.sh shape`, tc's token bucket)
and a pair of jobs runs there: fp32 and FP8 with the float8 all-gather (torchao, emulated on CPU),
each starting with `--preflight full`, whose across-nodes all-gather gives the link's bus
bandwidth. From each job of the unshaped pair, the projection predicts its step time at every
rate from that rate's measured bandwidth; printed per job: measured and projected median step
time after warm-up, and their ratio. Needs root, Slurm and munge (tools/install_test_deps.sh).
Not a test (a shared 2-core machine's times); tests/integration/test_slurm_e2e.py checks that
a shaped link measures slower and is named.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from analysis import project_scale as ps
from benchmarks._common import ROOT, checked
from model_utils.errors import OneLineParser

CLUSTER = ROOT / "tools" / "slurm_cluster.sh"
PAIR = {"fp32": ["--fp8=0"], "fp8-ag": ["--fp8=1", "--fp8_all_gather=1"]}
ARGS = ["--preset", "tiny", "--bf16=0", "--train_batch_size", "2", "--preflight", "full"]


def submit(env: dict[str, str], out: Path, name: str, args: list[str]) -> Path:
    """sbatch on both nodes as a user would, waited for; the run folder."""
    sbatch = ["sbatch", "--parsable", "--nodes=2", f"--job-name={name}", f"--output={out}/%x.out"]
    command = [*sbatch, str(ROOT / "1.train_llama.sbatch"), *args]
    job_env = {**env, "RUN_NAME": name, "RUNS_DIR": str(out), "NPROC_PER_NODE": "1"}
    done = subprocess.run(
        command, env=job_env, cwd=ROOT, capture_output=True, text=True, check=True
    )
    job = done.stdout.split(";")[0].strip()  # --parsable: "<job id>[;<cluster>]"
    while subprocess.run(
        ["squeue", "-h", "-j", job], env=env, capture_output=True, text=True
    ).stdout.strip():
        time.sleep(2)
    if not (out / name / "metrics.jsonl").exists():
        sys.exit(f"job {name} wrote no metrics:\n{(out / f'{name}.out').read_text()[-3000:]}")
    return out / name


def measured(run: Path) -> tuple[ps.Job, ps.Links]:
    """The run as project_scale's Job (median tokens/s after step 5), and the links its
    preflight measured."""
    return ps.job_of(str(run)), ps.links_of(json.loads((run / "preflight.json").read_text()))


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="off,1gbit,200mbit", help="tc rates; off = unshaped")
    parser.add_argument("--steps", type=checked(int, lambda n: n > 5, "> 5 (warm-up)"), default=12)
    parser.add_argument("--runs", metavar="DIR", help="an earlier run's folder: projected again")
    args = parser.parse_args(argv)
    rates = args.rates.split(",")
    if rates[0] != "off" or (os.geteuid() != 0 and not args.runs):
        parser.error("runs as root (namespaces, tc), and --rates starts with off (the base)")
    try:  # an earlier run's folder that lacks one of the runs: one line
        if args.runs:
            return report({(a, r): Path(args.runs, f"{a}-{r}") for a in PAIR for r in rates}, rates)
    except ValueError as exc:
        parser.error(str(exc))
    state = Path(tempfile.mkdtemp(prefix="shaped-links-"))
    cluster = state / "cluster"
    two_nodes = {**os.environ, "SLURM_CLUSTER_NODES": "2"}
    started = subprocess.run(
        [str(CLUSTER), "start", str(cluster)], capture_output=True, text=True, env=two_nodes
    )
    if started.returncode:
        sys.exit(started.stderr)
    env = {**os.environ, "SLURM_CONF": str(cluster / "slurm.conf"), "OMP_NUM_THREADS": "1"}
    runs: dict[tuple[str, str], Path] = {}
    try:
        for rate in rates:
            for node in ("1", "2"):
                subprocess.run([str(CLUSTER), "shape", str(cluster), node, rate], check=True)
            for arm, flags in PAIR.items():
                name = f"{arm}-{rate}"
                runs[arm, rate] = submit(
                    env, state, name, [*ARGS, "--max_steps", str(args.steps), *flags]
                )
    finally:
        subprocess.run([str(CLUSTER), "stop", str(cluster)], check=False)
    print(f"(runs in {state})")
    return report(runs, rates)


def report(runs: dict[tuple[str, str], Path], rates: list[str]) -> int:
    """Per job and rate: the link's measured bus bandwidth, the measured and the projected
    median step time (after step 5) and their ratio."""
    head = ("job", "rate", "link GB/s", "measured s", "projected s", "ratio")
    print("".join(f"{h:>12s}" for h in head))
    for arm in PAIR:
        job, base_links = measured(runs[arm, "off"])
        for rate in rates:
            step, links = measured(runs[arm, rate])
            tokens = ps.projected(job, (2, 1), 2, 1, links=links, base_links=base_links)
            guess = job.tokens_per_gpu / tokens
            cells = (links.network, step.step_seconds, guess, guess / step.step_seconds)
            print(f"{arm:>12s}{rate:>12s}" + "".join(f"{c:12.3f}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
