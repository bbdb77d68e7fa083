"""train.py end to end on CPU: loss goes down, the log line, FP8 parity, resume, preemption,
gradient accumulation on 2 ranks."""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
from pathlib import Path

import pytest
from helpers import doc_logs
from helpers.runs import FAST, TINY_WIDTH, losses, records, run_train, train_cmd, train_env

from model_utils.config.arguments import parse_args

SEED_LINE = re.compile(
    r"Batch (\d+) Loss: (\d+\.\d{5}), Speed: (\d+\.\d{2}) samples/sec, lr: (\d+\.\d{6})$"
)


def test_loss_goes_down_and_log_lines_have_the_seed_format(tmp_path):
    """The whole of train.py in a world of one, here without FSDP2 (--sharding_strategy none);
    the other runs of this file are FSDP2's. fp32 compute (FAST): bf16 matmuls are tens of
    times slower than fp32 ones on a CPU without bf16 units, and the bf16 autocast path
    without FSDP2 is tests/unit/test_unsharded.py's (it trains like FSDP2, on every backend)."""
    out = tmp_path / "run"
    no_fsdp2 = ["--sharding_strategy=none"]
    steps = ["--max_steps=30", "--warmup=5"]
    result = run_train(*FAST, *TINY_WIDTH, *no_fsdp2, *steps, f"--output_dir={out}")
    assert "precision: fp32 compute, fp32 master weights, no FSDP2" in result.stdout
    assert "world: 1 ranks (1 nodes), cpu, no FSDP2; global batch 4 sequences" in result.stdout
    seed_lines = [m for ln in result.stdout.splitlines() if (m := SEED_LINE.search(ln))]
    assert [int(m.group(1)) for m in seed_lines] == list(range(1, 31))
    # The printed numbers are the JSONL numbers, formatted exactly as upstream.
    by_step = {r["step"]: r for r in records(out)}
    for m in seed_lines:
        rec = by_step[int(m.group(1))]
        assert m.group(2) == f"{rec['loss']:.5f}" and m.group(4) == f"{rec['lr']:.6f}"
    assert "tokens/s/device" in result.stdout and "data wait" in result.stdout
    first, last = by_step[1]["loss"], by_step[30]["loss"]
    assert last < first - 2.0, (first, last)  # from ~ln(8192)=9.0 to well below
    val = records(out, "val")
    assert val and val[-1]["val_loss"] < first - 2.0
    # upstream's validation line too, so its log parsers find the validation
    assert f"Batch 30 Validation loss: {val[-1]['val_loss']:.5f}" in result.stdout
    assert "Summary (medians over" in result.stdout
    # README's and docs/' samples of these lines tag them as this run does
    checked, wrong = doc_logs.tag_mismatches(result.stdout)
    assert checked >= 9 and wrong == [], wrong
    # The run's resolved flags, which `train.py @FILE` runs again, are in its folder.
    again = parse_args([f"@{out / 'run.args'}", f"--output_dir={out}"]).as_dict()
    ran = {k: v for k, v in records(out, "run")[0]["flags"].items() if k in again}
    assert {k for k in again if again[k] != ran[k]} <= {"tokenizer_sha256", "data_fingerprint"}


def test_fp8_emulated_stays_within_2_percent_of_the_same_run_without_it(tmp_path):
    """train.py --fp8=1 end to end (torchao's FP8 emulated on CPU) against the same run without
    FP8, every step, both computing in fp32 (FAST's --bf16=0: only the FP8 casts differ). (FP8
    against bf16, 1 vs 2 ranks, FP8 all-gather and the same closeness under FSDP2 on fixed
    batches: test_distributed's parity runs.)"""
    runs = {}
    for fp8 in (0, 1):
        out = tmp_path / f"fp8_{fp8}"
        run_train(
            *FAST,
            *TINY_WIDTH,
            "--train_batch_size=2",
            "--max_steps=10",
            f"--fp8={fp8}",
            "--logging_freq=1",
            "--validation_batches=1",
            f"--output_dir={out}",
        )
        runs[fp8] = losses(out)
    bf16, fp8 = runs[0], runs[1]
    assert sorted(fp8) == sorted(bf16) == list(range(1, 11))
    assert all(math.isfinite(loss) for loss in fp8.values()) and fp8[10] < fp8[1] - 1.0, fp8
    assert all(abs(fp8[s] - bf16[s]) / bf16[s] < 0.02 for s in bf16), runs
    assert fp8 != bf16  # FP8 numerics really ran (an exact tie would mean no FP8 casts)


@pytest.mark.parametrize("masters", ["params", "optimizer"])
def test_two_rank_resume_reproduces_the_uninterrupted_run_bit_for_bit(tmp_path, masters):
    """With --master_weights optimizer the checkpoint holds bf16 weights and fp32 masters, and
    the resume must restore both (a load that rounded the masters would drift from step 5)."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    # bf16 on few tokens (one 32-token sequence a rank): bf16 matmuls are tens of times slower
    # than fp32 ones on a CPU without bf16 units, and exactness needs no more.
    common = [*FAST, "--bf16=1", "--train_batch_size=1", "--max_context_width=32"]
    common += ["--max_steps=8", "--warmup=2", "--validation_batches=2", "--global_batch_size=2"]
    common.append(f"--master_weights={masters}")
    run_train(*common, "--checkpoint_freq=4", f"--output_dir={full}", nproc=2)
    checkpoint = full / "checkpoints" / "step_00000004"
    assert checkpoint.is_dir()
    result = run_train(
        *common, f"--output_dir={resumed}", f"--resume_from_checkpoint={checkpoint}", nproc=2
    )
    assert "Resumed from" in result.stdout and "at step 4" in result.stdout
    assert (
        "at step 4 (data checked: size, ends and 16 sampled blocks of 1 file(s))" in result.stdout
    )
    assert f"optimizer: {OPTIMIZER_LINE[masters]}\n" in result.stdout
    want, got = losses(full), losses(resumed)
    assert sorted(got) == [5, 6, 7, 8]
    assert [got[s] for s in got] == [want[s] for s in got]  # exact, not approximate
    assert records(resumed, "val")[-1]["val_loss"] == records(full, "val")[-1]["val_loss"]
    assert saved_dtypes(checkpoint) == SAVED_DTYPES[masters]
    # What the run has seen carries on from the checkpoint: 1 sequence x 2 ranks x 32 tokens a
    # step, and the elapsed time of the launch before it.
    seen = {r["step"]: (r["samples_seen"], r["tokens_seen"]) for r in records(resumed)}
    assert seen == {s: (2 * s, 64 * s) for s in (5, 6, 7, 8)}
    assert [r["tokens_seen"] for r in records(full)] == [64 * s for s in range(1, 9)]
    before = json.loads((checkpoint / "checkpoint.json").read_text())["seen"]["seconds"]
    assert records(resumed)[0]["elapsed_seconds"] > before > 0
    assert ", seen: 512 tokens, elapsed: " in result.stdout  # step 8's line
    if masters == "params":  # the same flags on one rank: twice the accumulation, same batches
        one = tmp_path / "one_rank"
        argv = [*common, f"--output_dir={one}", f"--resume_from_checkpoint={checkpoint}"]
        said = run_train(*argv).stdout
        assert "data stream continues each of its 2 shards where it stopped (2 a rank)" in said
        got = losses(one)
        assert all(abs(got[s] - want[s]) < 1e-3 * want[s] for s in (5, 6, 7, 8)), (got, want)
        one_val, full_val = (
            records(one, "val")[-1]["val_loss"],
            records(full, "val")[-1]["val_loss"],
        )
        assert abs(one_val - full_val) < 1e-3 * full_val  # the same validation set
        assert [records(r, "val")[-1]["val_batches"] for r in (one, full)] == [4, 4]  # 2 a shard


def test_a_bf16_cool_down_switches_once_and_resumes_exactly_across_the_switch(tmp_path):
    """--bf16_cooldown 0.5 of 8 steps: FP8 (emulated) for steps 1-4, off for 5-8, said once in
    the log. Resumes from step 2 (before the switch) and step 6 (after it: FP8 off from the
    first step) end bit for bit where the uninterrupted run does; the run's flags record the
    fraction, and a resume of the run's own checkpoint with another is refused."""
    full = tmp_path / "full"
    common = [*FAST, "--train_batch_size=2", "--max_context_width=64", "--fp8=1"]
    common += ["--max_steps=8", "--warmup=2", "--validation_batches=1", "--bf16_cooldown=0.5"]
    result = run_train(*common, "--checkpoint_freq=2", "--keep_last=0", f"--output_dir={full}")
    switch = "BF16 cool-down: steps 5-8 train with FP8 off (--bf16_cooldown)"
    assert result.stdout.count("BF16 cool-down") == 1 and switch in result.stdout
    assert "BF16 from step 5" in result.stdout  # the start-up line
    assert records(full, "run")[0]["flags"]["bf16_cooldown"] == 0.5
    want = losses(full)
    for step in (2, 6):
        resumed = tmp_path / f"from_{step}"
        checkpoint = full / "checkpoints" / f"step_{step:08d}"
        result = run_train(
            *common, f"--output_dir={resumed}", f"--resume_from_checkpoint={checkpoint}"
        )
        got = losses(resumed)
        assert [got[s] for s in sorted(got)] == [want[s] for s in range(step + 1, 9)], step
        assert f"steps {max(step + 1, 5)}-8 train with FP8 off" in result.stdout
    other = [*common[:-1], "--bf16_cooldown=0.25", f"--output_dir={full}"]
    refused = subprocess.run(
        train_cmd(*other, "--resume_from_checkpoint=auto"),
        capture_output=True,
        text=True,
        env=train_env(),
        timeout=300,
    )
    assert refused.returncode == 2 and "--bf16_cooldown" in refused.stdout + refused.stderr


#: The start-up line's optimizer, by --master_weights (on CPU: torch's AdamW, or ours).
OPTIMIZER_LINE = {
    "params": "torch.optim.adamw.AdamW",
    "optimizer": "model_utils.precision.master_weights.MasterWeightAdamW, "
    "fp32 master weights in the optimizer",
}


#: What a checkpoint holds, by kind of entry: model weights, and each optimizer state field.
SAVED_DTYPES = {
    "params": {"model": {"float32"}, "exp_avg": {"float32"}, "exp_avg_sq": {"float32"}},
    "optimizer": {
        "model": {"bfloat16"},
        "exp_avg": {"float32"},
        "exp_avg_sq": {"float32"},
        "master_param": {"float32"},
    },
}


def saved_dtypes(checkpoint: Path) -> dict[str, set[str]]:
    """The dtypes of a DCP checkpoint's weight and optimizer-state tensors, from its metadata."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    found: dict[str, set[str]] = {}
    for key, md in FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata) or not md.size:
            continue  # scalars (steps), bytes, RNG states
        if key.startswith("model.") and "_extra_state" not in key:
            kind = "model"
        elif key.startswith("optimizer.state."):
            kind = key.rsplit(".", 1)[1]
        else:
            continue
        found.setdefault(kind, set()).add(str(md.properties.dtype).removeprefix("torch."))
    return found


def test_preemption_signal_checkpoints_and_auto_resume_finishes_the_same(tmp_path):
    """SIGUSR1 (what Slurm sends before the time limit) -> checkpoint at the step boundary, exit 0;
    the rerun with --resume_from_checkpoint auto ends where an uninterrupted run ends."""
    common = [*FAST, "--max_steps=12", "--warmup=2", "--validation_batches=1"]
    reference = tmp_path / "reference"
    run_train(*common, f"--output_dir={reference}")

    out, export = tmp_path / "preempted", tmp_path / "hf"
    argv = [
        *common,
        f"--output_dir={out}",
        "--resume_from_checkpoint=auto",
        f"--export_hf={export}",
    ]
    proc = subprocess.Popen(
        train_cmd(*argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=train_env(),
    )
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "Batch 3 Loss" in line:
            proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=300) == 0, "".join(seen)
    text = "".join(seen)
    stopped = int(re.search(r"checkpoint saved at step (\d+)", text).group(1))
    assert 3 <= stopped < 12
    assert f"Batch {stopped + 1} Loss" not in text
    assert f"; --export_hf {export} is written when a resume ends at step 12" in text
    assert not export.exists()

    result = run_train(*argv)
    assert f"at step {stopped}" in result.stdout
    assert losses(out)[12] == losses(reference)[12]
    # A resume continues its run's metrics.jsonl: both segments, one summary over 12 steps.
    assert "kept as" not in result.stdout and not (out / "metrics.1.jsonl").exists()
    assert not (out / "run.1.args").exists()
    assert sorted(losses(out)) == list(range(1, 13))
    assert "last step 12" in result.stdout
    assert (export / "model.safetensors").is_file()

    # Requeued once finished: the validation of step 12's weights is in metrics.jsonl, so it is
    # not run (nor recorded) again; the summary still reports it.
    def validations() -> list[int]:
        return [r["step"] for r in records(out, "val")]

    assert validations() == [12]
    argv.remove(f"--export_hf={export}")  # an export is never replaced
    again = run_train(*argv)
    assert "Validation at" not in again.stdout and validations() == [12], again.stdout
    assert "final validation loss" in again.stdout
    # Stopped after step 12's save but before the end's validation: the relaunch validates.
    kept = [ln for ln in (out / "metrics.jsonl").read_text().splitlines() if '"val"' not in ln]
    (out / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    again = run_train(*argv)
    assert "Validation at step 12" in again.stdout and validations() == [12], again.stdout


def test_a_fresh_run_sets_an_earlier_runs_metrics_aside(tmp_path):
    """Two fresh runs into one --output_dir (no checkpoints): the second's metrics.jsonl,
    TensorBoard folder and run.args hold only its own; the first's are kept beside them (its
    run.args was replaced)."""
    out = tmp_path / "run"
    common = [*FAST, "--warmup=1", "--validation_batches=1", "--checkpoint_freq=-1"]
    common += ["--tensorboard=1", f"--output_dir={out}", "--profile_steps=2:2"]
    run_train(*common, "--max_steps=3")
    first_trace = next((out / "profile" / "step_2").iterdir()).read_bytes()
    second = run_train(*common, "--max_steps=2")
    # step_breakdown reads the folder's traces as its run's: the first's, of the same window,
    # were overwritten, or (another window) read and labelled as the second run's
    assert f"profile/ here held its traces: kept as {out / 'profile.1'}" in second.stdout
    assert next((out / "profile.1" / "step_2").iterdir()).read_bytes() == first_trace
    assert (out / "profile" / "step_2").is_dir()
    assert f"kept as {out / 'metrics.1.jsonl'}" in second.stdout
    assert f"kept in {out / 'tensorboard.1'}" in second.stdout
    assert f"run.args here held its flags: kept as {out / 'run.1.args'}" in second.stdout
    assert "--max_steps=3" in (out / "run.1.args").read_text().splitlines()  # the first's
    assert "--max_steps=2" in (out / "run.args").read_text().splitlines()
    assert sorted(losses(out)) == [1, 2]
    first = [json.loads(ln) for ln in (out / "metrics.1.jsonl").read_text().splitlines()]
    assert [r["step"] for r in first if r["kind"] == "train"] == [1, 2, 3]
    assert [p.name for p in (out / "tensorboard").iterdir()] != []
    assert "last step 2" in second.stdout


# ~66M parameters and tiny activations: gradients dominate what a rank holds. fp32 compute
# (--bf16=0): what accumulation keeps alive is the fp32 gradient either way (FSDP2 accumulates
# the unsharded gradient in fp32, the reduce dtype, under bf16 too), and bf16 matmuls run 20-60x
# slower than fp32 ones on a CPU without bf16 units (this test took 268 s of a 2-worker run).
GRADIENT_HEAVY = [
    "--bf16=0",
    "--hidden_width",
    "512",
    "--num_layers",
    "8",
    "--num_heads",
    "8",
    "--num_key_value_heads",
    "8",
    "--intermediate_size",
    "2048",
    "--vocab_size",
    "32000",
    "--max_context_width",
    "32",
    "--train_batch_size",
    "1",
    "--validation_batches",
    "1",
    "--checkpoint_freq",
    "-1",
    "--max_steps",
    "2",  # the first step allocates all a rank holds: gradients, Adam's moments
    "--warmup",
    "1",
]


@pytest.mark.slow
def test_grad_accumulation_keeps_gradients_sharded(tmp_path, monkeypatch):
    """FSDP2 with gradient sync off holds every gradient unsharded in fp32 until the last
    micro-batch: 4 B x parameters per rank (32 GB for Llama3-8B). Reduce-scattering each
    micro-batch leaves only what accumulation means: the *sharded* fp32 gradient, 4 B x
    parameters / ranks, alive during the later micro-batches.

    Two micro-batches show it as well as more: the second runs while the first's gradient is
    held. On 2 ranks, 66M parameters (2026-11-28): +0.16 GiB with sync off (planted in
    sync_gradients), +0.06 GiB as it is; the unsharded gradient is 0.25 GiB. Large allocations
    go through mmap so that RSS tracks live memory instead of glibc's heap high-water mark (the
    ranks start warm and set it with mallopt: +0.157 GiB planted, +0.059 as it is, 2026-12-07).
    """
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    peaks = {}
    for accum in (1, 2):
        out = tmp_path / f"accum{accum}"
        run_train(*GRADIENT_HEAVY, f"--grad_accum_steps={accum}", f"--output_dir={out}", nproc=2)
        peaks[accum] = max(r["peak_mem_gib"] for r in records(out))
    unsharded_grads_gib = 66.3e6 * 4 / 2**30
    print(f"\npeak RSS rank 0: accumulation 1 {peaks[1]:.3f} GiB, 2 {peaks[2]:.3f} GiB")
    assert peaks[2] - peaks[1] < 0.5 * unsharded_grads_gib, peaks


def test_grad_accumulation_counts_the_global_batch(tmp_path):
    out = tmp_path / "accum"
    run_train(
        *FAST,
        "--max_steps=2",
        "--warmup=1",
        "--grad_accum_steps=2",
        "--validation_batches=1",
        f"--output_dir={out}",
    )
    rec = records(out)[-1]
    assert rec["samples"] == 4 * 2  # micro-batch x accumulation x world size 1
