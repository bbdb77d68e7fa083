"""--reduce_dtype fp8 on gloo ranks: the comm against FSDP2's fp32 reduce-scatter (its values
within FP8's rounding, its counted bytes about a quarter), and train.py with it on two ranks
against fp32 (losses down, compare_runs' parity verdict, bytes per step in metrics.jsonl, an
exact resume)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers.procs import PYTHON, spawn_ranks
from helpers.runs import FAST, losses, records, run_train

from model_utils.parallel import fp8_reduce

ROOT = Path(__file__).resolve().parents[2]
#: Gradients of a layer: matmul rows around 1e-3 and norm weights around 1e-6 in one chunk,
#: a chunk that is no multiple of the block, a block of zeros.
CHUNK = 1000


def _gradients(rank: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    chunks = torch.randn(world, CHUNK, generator=g) * 1e-3
    chunks[:, 900:] *= 1e-3
    chunks[:, 128:256] = 0.0
    return chunks.flatten()


def _comm_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    grads = _gradients(rank, world)
    result = {}
    for name in ("fp32", "fp8"):
        comm = fp8_reduce.Fp8ReduceScatter() if name == "fp8" else fp8_reduce.CountedReduceScatter()
        for op in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
            output = torch.empty(CHUNK)
            comm(output, grads.clone(), dist.group.WORLD, op)
            result[f"{name} {op}"] = output.tolist()
        result[f"{name} bytes"] = comm.bytes_sent
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.slow
def test_the_fp8_reduce_scatter_sums_within_fp8_rounding_in_a_quarter_of_the_bytes(tmp_path):
    world = 4
    spawn_ranks(_comm_worker, world, str(tmp_path))
    exact = sum(_gradients(r, world).view(world, CHUNK) for r in range(world))
    for rank in range(world):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        want = exact[rank]
        assert torch.tensor(got["fp32 RedOpType.SUM"]).allclose(want, rtol=1e-5, atol=1e-10)
        for op, divide in (("SUM", 1), ("AVG", world)):
            fp8 = torch.tensor(got[f"fp8 RedOpType.{op}"]) * divide
            # e4m3 keeps 3 mantissa bits: each of the 4 summands within 2^-4 of itself
            bound = sum(_gradients(r, world).view(world, CHUNK)[rank].abs() for r in range(world))
            assert ((fp8 - want).abs() <= bound / 16 + 1e-30).all(), op
            assert (fp8 - want).norm() / want.norm() < 0.03, op
            assert (fp8[900:] != 0).all()  # the small norm-like gradients are not flushed
            assert (fp8[128:256] == 0).all()
        # two calls each: 3 of 4 chunks leave the rank; fp8: 1000 values padded to 1024 + 8 scales
        assert got["fp32 bytes"] == 2 * 3 * CHUNK * 4
        assert got["fp8 bytes"] == 2 * 3 * (1024 + 8 * 4)
        assert got["fp8 bytes"] / got["fp32 bytes"] == pytest.approx(0.264, abs=0.001)


# ------------------------------------------------------- train.py on two ranks, fp32 and fp8

#: FAST's tiny model (fp32 compute: only the reduce differs), 20 steps, a report each step.
RUN = [*FAST, "--train_batch_size=2", "--max_context_width=64", "--max_steps=20", "--warmup=2"]
RUN += ["--logging_freq=1", "--validation_freq=10", "--validation_batches=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """fp32 and fp8 reduce, the fp8 run checkpointed at step 10 and resumed from there."""
    root = tmp_path_factory.mktemp("reduce")
    logs = {}
    for name in ("fp32", "fp8"):
        out = f"--output_dir={root / name}"
        logs[name] = run_train(*RUN, f"--reduce_dtype={name}", "--checkpoint_freq=10", out, nproc=2)
    checkpoint = root / "fp8" / "checkpoints" / "step_00000010"
    resume = [f"--output_dir={root / 'resumed'}", f"--resume_from_checkpoint={checkpoint}"]
    logs["resumed"] = run_train(*RUN, "--reduce_dtype=fp8", *resume, nproc=2)
    for name, done in logs.items():
        (root / f"{name}.log").write_text(done.stdout)
    return root


@pytest.mark.slow
def test_fp8_reduce_trains_like_fp32_by_the_parity_verdict(runs: Path) -> None:
    fp8 = losses(runs / "fp8")
    assert sorted(fp8) == list(range(1, 21)) and fp8[20] < fp8[1] - 1.0, fp8
    assert fp8 != losses(runs / "fp32")  # the fp8 wire really ran
    compare = [PYTHON, "-m", "analysis.compare_runs", str(runs / "fp32"), str(runs / "fp8")]
    done = subprocess.run(
        [*compare, "--output", str(runs / "compare.png")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert re.search(r"verdict: .*\(fp8\) matches .*\(fp32\) over steps 2-20", done.stdout), (
        done.stdout
    )
    gap = re.search(r"train loss gap: mean ([-+.\d]+)%, largest ([-+.\d]+)%", done.stdout)
    assert gap and abs(float(gap[2])) < 0.5, done.stdout


@pytest.mark.slow
def test_each_step_counts_about_a_quarter_of_fp32s_bytes(runs: Path) -> None:
    sent = {
        name: {r["grad_reduce_bytes"] for r in records(runs / name)} for name in ("fp32", "fp8")
    }
    assert len(sent["fp32"]) == len(sent["fp8"]) == 1  # the same bytes every step
    fp32, fp8 = sent["fp32"].pop(), sent["fp8"].pop()
    assert 0.25 < fp8 / fp32 < 0.27, (fp8, fp32)
    assert "fp8 gradient reduce" in (runs / "fp8.log").read_text()  # the precision line


@pytest.mark.slow
def test_a_resume_with_fp8_reduce_repeats_the_run_exactly_and_keeps_it(
    runs: Path, refused_by_train
) -> None:
    want, got = losses(runs / "fp8"), losses(runs / "resumed")
    assert sorted(got) == list(range(11, 21))
    assert [got[s] for s in got] == [want[s] for s in got]  # exact, not approximate
    assert [r["val_loss"] for r in records(runs / "resumed", "val")] == [
        r["val_loss"] for r in records(runs / "fp8", "val") if r["step"] > 10
    ]
    checkpoint = runs / "fp8" / "checkpoints" / "step_00000010"
    _, lines, _ = refused_by_train(
        *RUN,
        "--reduce_dtype=fp32",
        f"--output_dir={runs / 'fp8'}",
        f"--resume_from_checkpoint={checkpoint}",
    )
    assert "--reduce_dtype fp8 -> fp32" in lines[0], lines


@pytest.mark.slow
def test_one_rank_is_told_that_fp8_reduce_does_nothing_and_trains_as_fp32(tmp_path) -> None:
    """In a world of one FSDP2 copies the gradients and calls no reduce-scatter (torch's
    _fsdp_collectives.foreach_reduce): the flag changes no loss, and the run says so once, so a
    one-GPU A/B of it is not read as FP8 gradients costing nothing."""
    short = [*FAST, "--train_batch_size=2", "--max_context_width=64", "--max_steps=3"]
    short += ["--warmup=1", "--validation_batches=1"]
    done = {}
    for name in ("fp32", "fp8"):
        out = f"--output_dir={tmp_path / name}"
        done[name] = run_train(*short, f"--reduce_dtype={name}", out, nproc=1)
    warning = "--reduce_dtype fp8 reduces nothing in a world of one"
    assert done["fp8"].stdout.count(warning) == 1 and warning not in done["fp32"].stdout
    assert losses(tmp_path / "fp8") == losses(tmp_path / "fp32")
