"""Never lose a run (issue 11), with real processes: what train.py refuses, keeps and says when
things go wrong.

Behaviour of the process (exit status, the one error line, what is left on disk) is tested by
running train.py as users do, on the tiny preset with short windows and few steps; agreement
between ranks on a real gloo process group of 2 processes.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.procs import PYTHON, signal_after, spawn_ranks
from helpers.runs import FAST, TINY_WIDTH, records

from model_utils import checkpoint as ck
from model_utils.checkpoint.hf import existing_model
from model_utils.checkpoint.layout import iter_dcp_model_layers
from model_utils.checkpoint.manifest import checkpoint_name, step_of
from model_utils.report import metrics
from model_utils.run import guards, run_lock

ROOT = Path(__file__).resolve().parents[2]


def train(*argv: str, cwd: Path | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [PYTHON, str(ROOT / "train.py"), *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd or ROOT,
    )


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in result.stderr.splitlines() if ln.startswith("train.py: error:")]


# ============================================================================================
# 1. Non-finite training never reaches a checkpoint


def _guard_worker(rank: int, world_size: int, port: int, results: dict) -> None:
    """Rank 1 alone sees a NaN loss at step 3 and an inf grad norm at step 5; rank 0 alone
    receives a stop signal. Every rank must see the same answers."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        guard = guards.StepGuard(torch.device("cpu"))
        seen = []
        for step in range(1, 7):
            loss = torch.tensor(float("nan") if (rank, step) == (1, 3) else 1.0)
            norm = torch.tensor(float("inf") if (rank, step) == (1, 5) else 0.5)
            guard.observe(step, loss, norm)
            if step in (2, 4, 6):
                seen.append(guard.agree(stop_requested=rank == 0 and step == 6))
        fresh = guards.StepGuard(torch.device("cpu"))
        weights = [torch.ones(3), torch.tensor([1.0, math.inf]) if rank == 0 else torch.ones(2)]
        fresh.observe_weights(9, weights)
        seen.append(fresh.agree(False))
        results[rank] = seen
    finally:
        dist.destroy_process_group()


def test_ranks_agree_on_the_first_non_finite_step_and_on_a_stop_request() -> None:
    results = mp.Manager().dict()
    spawn_ranks(_guard_worker, 2, results)
    expected = [(False, None), (False, 3), (True, 3), (False, 9)]
    assert results[0] == results[1] == expected


def _weights_are_finite(path: Path) -> bool:
    return all(
        bool(torch.isfinite(t).all())
        for layer in iter_dcp_model_layers(path)
        for t in layer.values()
    )


@pytest.mark.parametrize(
    ("extra", "saved"),
    [
        # A checkpoint every step, keep 2: before, both survivors held NaN and every finite
        # checkpoint was pruned.
        (["--checkpoint_freq", "1", "--keep_last", "2", "--logging_freq", "1"], 2),
        # Logged every 5 steps, saved at the end only: the first bad step (not the report step)
        # is named, and the end-of-run save never happens.
        (["--checkpoint_freq", "0", "--logging_freq", "5"], 0),
    ],
)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_diverging_run_stops_naming_the_step_and_saves_nothing_non_finite(
    tmp_path: Path, extra: list[str], saved: int
) -> None:
    out = tmp_path / "run"
    result = train(
        *FAST,
        *TINY_WIDTH,  # at half the width, the gradient norm is NaN at step 2: before 2 saves
        "--max_steps",
        "10",
        "--warmup",
        "1",
        "--lr",
        "1e6",
        f"--output_dir={out}",
        "--export_hf",
        str(tmp_path / "hf"),
        *extra,
    )
    assert result.returncode == guards.EXIT_DIVERGED, result.stderr[-3000:]
    [line] = error_lines(result)
    assert "Traceback" not in result.stderr
    step = int(line.split(" at step ")[1].split(",")[0])
    logged = [ln.split("Batch ")[1] for ln in result.stdout.splitlines() if "Batch " in ln]
    # the first report that recorded a NaN/inf (the loss, or the gradient norm before it)
    first_bad = next(r["step"] for r in records(out) if r.get("not_finite"))
    if "5" in extra:  # a report every 5 steps: the step is found at the report after it
        assert step < first_bad == 5 and len(logged) == 1, result.stdout
    else:
        assert step == first_bad and int(logged[-1].split()[0]) == step, result.stdout
    assert "--lr" in line
    kept = ck.complete_checkpoints(out / "checkpoints")
    assert len(kept) == saved, kept
    assert all(step_of(p) < step and _weights_are_finite(p) for p in kept)
    if kept:  # where to resume from, and only advice a resume takes (it keeps its warm-up)
        assert str(kept[-1]) in line and "--warmup" not in line
    assert not (tmp_path / "hf").exists()  # nothing exported either


def test_lr_inf_exits_2_with_one_line_and_touches_nothing(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = train("--lr", "inf", f"--output_dir={out}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert error_lines(result) == ["train.py: error: --lr must be a finite number > 0, got inf"]
    assert "Traceback" not in result.stderr and not out.exists()


def _probe_race_worker(rank: int, world_size: int, port: int, out_dir: str, results) -> None:
    """The ranks of one node probe the same new checkpoint folder at once. Slowed down to the
    interleaving a fresh-clone make test hit: rank 0 holds the folder it made for 0.3 s (a slow
    fsync of its second probe, the checkpoint folder's) while rank 1 finds it there and writes
    its own probe 0.5 s later, after rank 0 is done with its probe."""
    import time

    from model_utils.config.arguments import parse_args
    from model_utils.parallel import distributed
    from model_utils.run import outputs

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        real_fsync, real_mkdir = os.fsync, Path.mkdir
        if rank == 0:
            synced = []

            def slow_fsync(fd: int) -> None:
                real_fsync(fd)
                synced.append(fd)
                if len(synced) == 2:  # the run folder's probe first, then the checkpoint folder's
                    time.sleep(0.3)

            os.fsync = slow_fsync
        else:

            def late_mkdir(self: Path, *args, **kwargs) -> None:
                time.sleep(0.1)
                real_mkdir(self, *args, **kwargs)
                time.sleep(0.5)

            Path.mkdir = late_mkdir
        args = parse_args(
            ["--output_dir", out_dir, "--checkpoint_dir", f"{out_dir}/checkpoints/run"]
        )
        world = distributed.World(rank, world_size, rank, world_size)
        dist.barrier()
        try:
            outputs.check_outputs(args, world, 1000, logging.getLogger("probe-race"))
            # when it returns, every rank's removal is done: nothing left to vanish later
            leftover = (Path(out_dir) / "checkpoints").exists()
            results[rank] = "ok" if not leftover else "a probe folder was still there"
        except outputs.WriteProblem as exc:
            results[rank] = str(exc)
    finally:
        dist.destroy_process_group()


def test_ranks_of_a_node_probing_one_new_checkpoint_folder_do_not_refuse_the_run(
    tmp_path: Path,
) -> None:
    """Every rank probes --checkpoint_dir before training; the folders the probes create go
    only after all ranks have probed, so no rank pulls the folder from under another's probe,
    and no rank returns before every removal is done (a folder vanishing after its return
    crashed a rank's checkpoint start-up); nothing is left behind."""
    out = tmp_path / "run"
    out.mkdir()  # rank 0's run lock has made the run folder by then
    results = mp.Manager().dict()
    spawn_ranks(_probe_race_worker, 2, str(out), results)
    assert dict(results) == {0: "ok", 1: "ok"}
    assert list(out.iterdir()) == []


# ============================================================================================
# 6. Interrupts and defaults


def test_ctrl_c_checkpoints_at_the_step_boundary_and_exits_0(tmp_path: Path) -> None:
    """SIGINT (Ctrl-C) is a stop request like SIGTERM/SIGUSR1, not a traceback and lost work."""
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [*FAST, "--max_steps", "1000", "--checkpoint_freq", "-1", f"--output_dir={out}"]
    cmd = [PYTHON, str(ROOT / "train.py"), *argv]
    status, log = signal_after(cmd, signal.SIGINT, env=env, cwd=ROOT)
    assert status == 0 and "Traceback" not in log and "KeyboardInterrupt" not in log, log
    step = int(log.split("checkpoint saved at step ")[1].split()[0])
    assert [step_of(p) for p in ck.complete_checkpoints(out / "checkpoints")] == [step]


# ============================================================================================
# 3. One run per directory


def _start(argv: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
    )


def _wait_for_line(proc: subprocess.Popen, text: str) -> str:
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if text in line:
            return "".join(seen)
    raise AssertionError(f"{text!r} never came:\n{''.join(seen)[-3000:]}")


def test_a_second_run_in_a_live_run_directory_is_refused_and_a_dead_ones_lock_is_not(
    tmp_path: Path, refused_by_train
) -> None:
    out = tmp_path / "run"
    argv = [*FAST, "--max_steps", "100000", f"--output_dir={out}", "--checkpoint_freq", "-1"]
    first = _start(argv)
    try:
        _wait_for_line(first, "Batch 1 Loss")
        metrics_before = (out / "metrics.jsonl").read_text()
        _, [line], stderr = refused_by_train(*argv)  # exit 2, one line
        assert f"pid {first.pid} on host {socket.gethostname()}" in line and str(out) in line
        assert "Traceback" not in stderr
        assert first.poll() is None  # the first run goes on, its log untouched by the second
        assert (out / "metrics.jsonl").read_text().startswith(metrics_before)
    finally:
        first.kill()  # SIGKILL: no clean-up runs, the lock file stays behind
        first.wait()
    assert (out / run_lock.LOCK_NAME).read_text().startswith(f"pid {first.pid} ")
    third = train(*FAST, "--max_steps", "2", f"--output_dir={out}", "--checkpoint_freq", "-1")
    assert third.returncode == 0, third.stderr[-3000:]
    assert "Batch 2 Loss" in third.stdout


def test_the_lock_covers_a_checkpoint_dir_outside_the_run_dir(tmp_path: Path) -> None:
    shared = tmp_path / "shared_ckpt"
    inside = run_lock.lock_dirs(str(tmp_path / "a"), str(tmp_path / "a" / "ckpt"))
    assert inside == {"--output_dir": tmp_path / "a"}
    outside = run_lock.lock_dirs(str(tmp_path / "a"), str(shared))
    assert outside == {"--output_dir": tmp_path / "a", "--checkpoint_dir": shared}
    held = run_lock.RunLock(shared).acquire()
    try:
        probe = subprocess.run(
            [
                PYTHON,
                "-c",
                "import sys; from model_utils.run import run_lock; "
                "print(run_lock.lock_holder(sys.argv[1]))",
                str(shared),
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            check=True,
        ).stdout
        assert probe.startswith(f"pid {os.getpid()} on host ")
        with pytest.raises(run_lock.RunLocked, match="shared_ckpt is in use by another run"):
            run_lock.check_not_locked(run_lock.lock_dirs(str(tmp_path / "b"), str(shared)).values())
    finally:
        held.release()
    assert run_lock.lock_holder(shared) is None
    assert run_lock.lock_holder(tmp_path / "never_used") is None
    assert not (tmp_path / "never_used").exists()


def test_resume_rules_end_to_end(tmp_path: Path, refused_by_train) -> None:
    """Through train.py: a plain re-run over checkpoints, a resume with another model shape,
    a resume with an explicit lr (applied, logged, recorded), and --overwrite_output_dir."""
    import json

    from model_utils import optim

    common = [*FAST, "--max_steps", "4", "--warmup", "1", "--validation_batches", "1"]
    first = tmp_path / "first"
    assert train(*common, "--checkpoint_freq", "2", f"--output_dir={first}").returncode == 0

    _, [line], _ = refused_by_train(*common, f"--output_dir={first}")  # exit 2, one line
    assert "--resume_from_checkpoint auto" in line
    assert "--overwrite_output_dir" in line

    _, [line], _ = refused_by_train(
        *common,
        f"--output_dir={first}",
        "--resume_from_checkpoint=auto",
        "--num_layers",
        "2",
        "--num_key_value_heads",
        "4",
    )
    assert "--num_key_value_heads 2 -> 4, --num_layers 4 -> 2" in line

    step2 = first / "checkpoints" / checkpoint_name(2)
    second = tmp_path / "second"
    lower = train(
        *common,
        f"--output_dir={second}",
        f"--resume_from_checkpoint={step2}",
        "--lr",
        "5e-4",
        "--train_batch_size",
        "2",
    )
    assert lower.returncode == 0, lower.stderr[-3000:]
    assert "Resumed schedule: lr 0.0005 (--lr given)" in lower.stdout
    assert "Resumed schedule: min_lr 0.0001 (saved; not given)" in lower.stdout
    assert "--train_batch_size 4 -> 2" in lower.stdout  # allowed, logged
    logged = {
        r["step"]: r["lr"]
        for r in map(json.loads, (second / "metrics.jsonl").open())
        if r.get("kind") == "train"
    }
    schedule = {"min_lr": 1e-4, "warmup": 1, "max_steps": 4, "style": "cosine"}
    assert logged[3] == pytest.approx(optim.lr_at(3, lr=5e-4, **schedule), rel=1e-9)
    final = ck.read_marker(second / "checkpoints" / checkpoint_name(4))["run_config"]
    assert (final["lr"], final["min_lr"]) == (5e-4, 1e-4)  # the values used, not the flags

    fresh = train(
        *FAST,
        "--max_steps",
        "1",
        "--checkpoint_freq",
        "-1",
        "--overwrite_output_dir",
        f"--output_dir={first}",
    )
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert ck.complete_checkpoints(first / "checkpoints") == []


def test_a_resume_refuses_a_tokenizer_retrained_in_place(tmp_path: Path) -> None:
    """The checkpoint records what its tokenizer does; the same --tokenizer path now
    lower-cases its input (same vocabulary size, other token ids): one line, exit 2."""
    import shutil

    from tokenizers import Tokenizer, normalizers

    tok = tmp_path / "tok"
    shutil.copytree(ROOT / "data" / "tokenizer", tok)
    common = [*FAST, "--warmup=1", "--validation_batches=1", f"--tokenizer={tok}"]
    common.append(f"--output_dir={tmp_path / 'run'}")
    first = train(*common, "--max_steps=2")
    assert first.returncode == 0, first.stderr[-2000:]
    retrained = Tokenizer.from_file(str(tok / "tokenizer.json"))
    retrained.normalizer = normalizers.Lowercase()
    retrained.save(str(tok / "tokenizer.json"))
    resumed = train(*common, "--max_steps=4", "--resume_from_checkpoint=auto")
    assert resumed.returncode == 2, resumed.stderr[-2000:]
    [line] = error_lines(resumed)
    assert "belongs to another run: the tokenizer's contents (sha256) " in line, line
    assert "Batch 3 Loss" not in resumed.stdout


def test_an_export_never_replaces_a_model(tmp_path: Path, refused_by_train) -> None:
    """At start: --export_hf into a folder that holds a model is one line, exit 2."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(b"the user's model")
    _, lines, _ = refused_by_train(*FAST, f"--output_dir={tmp_path / 'run'}", f"--export_hf={hf}")
    assert lines == [
        f"train.py: error: --export_hf {hf} already holds a model (model.safetensors): an "
        "export never replaces one; choose a new or empty directory, or move that model away"
    ]
    assert (hf / "model.safetensors").read_bytes() == b"the user's model"


def test_a_model_that_appears_in_the_export_dir_mid_run_is_kept_and_so_is_the_run(
    tmp_path: Path,
) -> None:
    """2 ranks: a model lands in --export_hf during the run. Rank 0 leaves it alone; both
    ranks still gather every layer (no hang), then stop with one line naming the final
    checkpoint, exit 1; the convert script writes the export from it elsewhere."""
    from helpers.procs import torchrun_cmd, warm_env

    hf, ckpt = tmp_path / "hf", tmp_path / "run" / "checkpoints"
    argv = [*FAST, "--max_steps=8", "--warmup=1", "--validation_batches=1"]
    argv += [f"--output_dir={tmp_path / 'run'}", f"--export_hf={hf}"]
    env = {**warm_env(), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        torchrun_cmd(str(ROOT / "train.py"), *argv, nproc=2),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
    )
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "Batch 2 Loss" in line:
            hf.mkdir()
            (hf / "model.safetensors").write_bytes(b"someone else's model")
    text = "".join(seen)
    assert proc.wait(timeout=300) != 0, text[-3000:]
    final = ckpt / checkpoint_name(8)
    [line] = [ln for ln in text.splitlines() if "train.py: error:" in ln]
    assert line.endswith(
        f"the Hugging Face export to {hf} failed: a model appeared there during the run "
        f"(model.safetensors); the checkpoint {final} holds the same weights: python "
        f"-m scripts.convert_checkpoint {final} DIR writes the export"
    ), line
    assert "]: Traceback" not in text  # no rank's (torchrun's agent reports the exit)
    assert sorted(p.name for p in hf.iterdir()) == ["model.safetensors"]
    assert (hf / "model.safetensors").read_bytes() == b"someone else's model"
    convert = subprocess.run(
        [
            PYTHON,
            str(ROOT / "scripts" / "convert_checkpoint.py"),
            str(final),
            str(tmp_path / "hf2"),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert convert.returncode == 0, convert.stderr
    assert existing_model(tmp_path / "hf2") == [  # the weights with their config and tokenizer
        *("config.json", "generation_config.json", "model.safetensors"),
        *("tokenizer.json", "tokenizer_config.json"),
    ]


def test_a_read_only_checkpoint_dir_is_refused_at_start(
    tmp_path: Path, small_disk, refused_by_train
) -> None:
    read_only = small_disk("ro", 4, read_only=True)
    out = tmp_path / "run"
    _, lines, _ = refused_by_train(
        *FAST, f"--output_dir={out}", f"--checkpoint_dir={read_only / 'ckpt'}"
    )
    assert lines == [
        f"train.py: error: --checkpoint_dir {read_only / 'ckpt'} cannot be written: {read_only} "
        "is on a read-only file system; choose another --checkpoint_dir"
    ]
    assert not out.exists()


def test_a_directory_the_system_will_not_create_is_one_line_not_a_traceback(
    tmp_path: Path, small_disk
) -> None:
    """A file system with no inode left looks writable to access(), so the start-up checks pass;
    rank 0's run lock is the first thing created, and its failure is the one line of a write
    problem (exit 2), not an OSError traceback."""
    no_inodes = small_disk("no_inodes", 4, inodes=1)  # the root directory takes the only one
    out = no_inodes / "run"
    result = train(*FAST, f"--output_dir={out}")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert error_lines(result) == [
        f"train.py: error: --output_dir {out} cannot be written (No space left on device): "
        "choose another --output_dir"
    ]
    assert list(no_inodes.iterdir()) == []


def test_a_run_dir_that_fills_up_mid_run_costs_the_metrics_not_the_run(
    tmp_path: Path, small_disk
) -> None:
    """--output_dir on a 16 KiB file system, checkpoints elsewhere: metrics.jsonl and
    TensorBoard fill it within a few steps. The run trains on to its last step and saves its
    checkpoints; each writer warns once; metrics.jsonl holds only whole records; no traceback
    (not even TensorBoard's writer thread's)."""
    run, ckpt = small_disk("full", 16 / 1024) / "run", tmp_path / "ckpt"
    result = train(
        *FAST,
        "--max_steps=12",
        "--warmup=1",
        "--validation_batches=1",
        "--checkpoint_freq=6",
        "--tensorboard=1",
        f"--output_dir={run}",
        f"--checkpoint_dir={ckpt}",
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "Exception in thread" not in result.stderr
    assert "Batch 12 Loss" in result.stdout
    saved = [checkpoint_name(6), checkpoint_name(12)]
    assert [p.name for p in sorted(ckpt.iterdir()) if p.is_dir()] == saved
    jsonl = [ln for ln in result.stdout.splitlines() if "metrics.jsonl cannot be written" in ln]
    board = [ln for ln in result.stdout.splitlines() if "tensorboard failed (" in ln]
    assert len(jsonl) == 1 and "(No space left on device)" in jsonl[0], result.stdout[-3000:]
    assert len(board) == 1 and "No space left on device" in board[0], result.stdout[-3000:]
    assert "no more tensorboard this run; training goes on" in board[0]
    assert "[train.py:" in jsonl[0]  # the line that reported (TensorBoard: its own thread)
    lost = int(jsonl[0].split("from step ")[1].split()[0])
    kept = metrics.read_jsonl(run / "metrics.jsonl")  # every line parses: no half record
    assert [r["step"] for r in kept if r["kind"] == "train"] == list(range(1, lost))
    assert f"it lost the records from step {lost} on" in result.stdout


def test_a_damaged_metrics_file_costs_the_summary_not_the_run(tmp_path: Path) -> None:
    """A resumed run whose metrics.jsonl was damaged in between (here: a line that is no JSON)
    appends to it and finishes; the end summary is replaced by one warning."""
    common = [*FAST, "--warmup=1", "--validation_batches=1", f"--output_dir={tmp_path}/r"]
    first = train(*common, "--max_steps=2")
    assert first.returncode == 0, first.stderr[-2000:]
    with open(tmp_path / "r" / "metrics.jsonl", "a") as fh:
        fh.write("not json\n")
    resumed = train(*common, "--max_steps=3", "--resume_from_checkpoint=auto")
    assert resumed.returncode == 0 and "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
    assert "Batch 3 Loss" in resumed.stdout and "Summary (" not in resumed.stdout
    [line] = [ln for ln in resumed.stdout.splitlines() if "No summary: " in ln]
    assert "metrics.jsonl cannot be read (JSONDecodeError: " in line


def test_a_full_disk_is_refused_before_training_or_named_at_save(tmp_path: Path, small_disk):
    """The tiny model's checkpoint is ~82 MiB: 50 MiB cannot hold one (refused at start-up);
    130 MiB holds one, so the second save fails: one line, and the first checkpoint stays."""
    common = [*FAST, *TINY_WIDTH, "--max_steps", "4", "--warmup", "1", "--validation_batches", "1"]
    tiny_disk = small_disk("tiny", 50)
    refused = train(
        *common, f"--output_dir={tmp_path / 'a'}", f"--checkpoint_dir={tiny_disk / 'ckpt'}"
    )
    assert refused.returncode == 2, refused.stderr[-2000:]
    [line] = error_lines(refused)
    assert f"{tiny_disk / 'ckpt'} has 0.05 GiB free, less than one checkpoint" in line
    assert "Batch 1 Loss" not in refused.stdout  # found before any training

    disk = small_disk("disk", 130)
    full = train(
        *common,
        "--checkpoint_freq",
        "2",
        f"--output_dir={tmp_path / 'b'}",
        f"--checkpoint_dir={disk}",
    )
    assert full.returncode == 1, full.stderr[-3000:]
    assert "less than the 3 checkpoints this run keeps" in full.stdout  # warned at start
    [line] = error_lines(full)
    first = disk / checkpoint_name(2)
    assert line.startswith(f"train.py: error: checkpoint step 4 could not be written to {disk}: ")
    assert "no space left on the device" in line and f"the newest checkpoint, {first}" in line
    assert "Traceback" not in full.stderr
    assert [p.name for p in disk.iterdir() if p.is_dir()] == [first.name]  # no temporary left
    assert ck.inspect_checkpoint(first, checksums=True) is None  # intact


def test_too_little_data_for_validation_is_one_line_before_the_model(tmp_path: Path) -> None:
    (tmp_path / "one.jsonl").write_text('{"text": "just a few words"}\n')
    result = train(*FAST, "--dataset", str(tmp_path / "one.jsonl"), f"--output_dir={tmp_path}/r")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    [line] = error_lines(result)
    assert "the validation part has only 0 windows" in line and "parameters" not in result.stdout


def test_a_bad_byte_met_mid_run_is_named_and_its_step_not_taken(tmp_path: Path) -> None:
    """Past the start-up scan (8 MiB per file) the stream meets a bad byte (the reader reads the
    file whole, so in step 1): the step is not taken, nothing is recorded or saved as if it had
    trained (a step-1 checkpoint and a loss of 0.0 used to be), exit 2 naming file and line.
    A failure later in a run: tests/integration/test_run_integrity_processes.py."""
    from model_utils.data import checks

    folder = tmp_path / "late"
    folder.mkdir()
    paragraph = ("in the beginning was the word " * 40 + "\n\n").encode()
    with open(folder / "train.txt", "wb") as fh:
        for _ in range(checks.SCAN_BYTES_PER_FILE // len(paragraph) + 200):
            fh.write(paragraph)
        fh.write(b"a bad \xff byte\n\n" + paragraph * 10)
    lines_before = (folder / "train.txt").read_bytes().split(b"\xff")[0].count(b"\n") + 1
    (folder / "validation.txt").write_bytes(paragraph * 300)
    out = tmp_path / "run"
    result = train(
        *FAST,
        "--max_steps",
        "10",
        "--warmup",
        "1",
        "--validation_batches",
        "1",
        "--dataset",
        str(folder),
        f"--output_dir={out}",
    )
    assert result.returncode == 2, result.stderr[-3000:]
    [line] = error_lines(result)
    assert f"{folder / 'train.txt'} line {lines_before} is not UTF-8 text" in line
    assert "mid-run" in line and "step 1 met it and was not taken: nothing was trained" in line
    assert ck.complete_checkpoints(out / "checkpoints") == []
    assert "Batch 1 Loss" not in result.stdout
    assert not [r for r in metrics.read_jsonl(out / "metrics.jsonl") if r.get("kind") == "train"]
