"""analysis/compare_runs.py: both input kinds, the table against hand-computed medians, the PNG
and its plotted data, the refusals. A real train.py run read both ways:
tests/integration/test_compare_runs_processes.py."""

from __future__ import annotations

import gzip
import json
import os
import re
import struct
import tarfile
from pathlib import Path

import pytest

from analysis import compare_plot, parity
from analysis import compare_runs as cr
from analysis.compare_trackers import tracker_names
from model_utils.config import flag_rules
from model_utils.config.arguments import parse_args
from model_utils.report import metrics

ROOT = Path(__file__).resolve().parents[2]


# (step, samples/s, loss) of two 50-step runs logged every 10 steps; step 10 is warm-up.
BF16 = [(10, 1.0, 9.0), (20, 10.0, 7.0), (30, 14.0, 6.0), (40, 12.0, 5.5), (50, 11.0, 5.0)]
FP8 = [(10, 2.0, 9.1), (20, 20.0, 7.1), (30, 18.0, 6.1), (40, 30.0, 5.6), (50, 19.0, 5.05)]
VAL = {"bf16": [(25, 6.5), (50, 5.2)], "fp8": [(25, 6.6), (50, 5.25)]}


def train_record(step: int, speed: float, loss: float) -> dict:
    """A train record with every metric a simple function of the speed, so medians are known."""
    return {
        "kind": "train",
        "step": step,
        "loss": loss,
        "lr": 1e-4,
        "samples_per_sec": speed,
        "tokens_per_sec_per_device": speed * 128,
        "tflops_per_device": speed / 10,
        "mfu": speed / 2,
        "peak_mem_gib": 1.0 + step / 100,
        "data_wait_pct": step / 10,
        "elapsed_seconds": float(step),
        "remaining_seconds": 50.0 - step,
    }


def info(**overrides) -> dict:
    """The run record train.py writes for the tiny preset on 2 ranks."""
    flags = parse_args(["--preset", "tiny", "--max_steps", "50"]).as_dict()
    flags.update(model_impl="hf", fp8_recipe="tensorwise", **overrides)
    return metrics.run_record(flags, world_size=2, samples_per_step=2 * flags["train_batch_size"])


def write_run_dir(path: Path, rows, val, run: dict | None, tokens_per_step: int = 0) -> Path:
    """A run folder's metrics.jsonl; with ``tokens_per_step``, its records count tokens seen."""
    seen = {"tokens_seen": 0} if tokens_per_step else {}
    with metrics.JsonlWriter(path / "metrics.jsonl") as writer:
        if run is not None:
            writer.write(run)
        for step, speed, loss in rows:
            seen = {"tokens_seen": step * tokens_per_step} if tokens_per_step else {}
            writer.write({**train_record(step, speed, loss), **seen})
            for vstep, vloss in val:
                if step - 10 < vstep <= step:
                    record = metrics.validation_record(
                        step=vstep, val_loss=vloss, batches=4, seconds=0.1
                    )
                    writer.write({**record, **seen})
    return path


def log_lines(rows, val, run: dict | None) -> list[str]:
    """What train.py prints (the real line functions), as srun -l and logging prefix it."""
    prefix = "0: 2026-11-23 10:00:00 I [train.py:140] "
    lines = [] if run is None else [prefix + "run: " + json.dumps(run)]  # an older log's line
    for step, speed, loss in rows:
        record = train_record(step, speed, loss)
        lines.append(prefix + metrics.seed_line(step, loss, speed, record["lr"]))
        lines.append(prefix + metrics.detail_line(record))
        lines += [
            f"{prefix}Validation at step {s}: loss {v:.5f} over 4 batches"
            for s, v in val
            if step - 10 < s <= step
        ]
    return lines


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line of a refusal (exit 2, nothing on stdout)."""
    assert cr.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    assert captured.err.startswith("compare_runs.py: error: ")
    return captured.err


# -------------------------------------------------------------------------------- parsing


def test_a_log_resumed_from_an_older_checkpoint_drops_the_abandoned_launch_s_steps(
    tmp_path: Path,
) -> None:
    """Launch 1 logged steps 10-40; launch 2 resumed from step 20's checkpoint (40's was
    damaged) and has logged step 30 again: step 40 of launch 1 is not part of the run."""
    lines = log_lines(BF16[:4], [], info())
    lines.append(
        "0: ... I [resume.py:281] Resumed from /r/checkpoints/step_00000020 at step 20 "
        "(data checked: sizes)"
    )
    lines += log_lines([(30, 13.0, 5.9)], [], None)
    path = tmp_path / "slurm-102.out"
    path.write_text("\n".join(lines) + "\n")
    train = [r for r in cr.load_run(path).records if r["kind"] == "train"]
    assert [(r["step"], r["loss"]) for r in train] == [(10, 9.0), (20, 7.0), (30, 5.9)]


def test_slurm_log_with_a_requeue_and_a_line_still_being_written(tmp_path: Path) -> None:
    lines = log_lines(BF16[:3], VAL["bf16"][:1], info())
    lines.insert(3, "1: 2026-11-23 10:00:01 W [data.py:9] a warning from rank 1")
    # Requeued after a checkpoint at step 20: step 30 is trained and logged again.
    lines.append("0: ... Preemption signal received: checkpoint saved at step 30")
    lines += log_lines([(30, 13.0, 5.9)], [], info())
    # The job is still running: its last line is half written (lr: 0.000100 -> 0.0001).
    text = (
        "\n".join(lines) + "\n0: ... Batch 40 Loss: 5.50000, Speed: 12.00 samples/sec, lr: 0.0001"
    )
    path = tmp_path / "slurm-101.out"
    path.write_text(text)

    run = cr.load_run(path)
    train = [r for r in run.records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [10, 20, 30]  # no step 40, step 30 once
    assert (train[2]["samples_per_sec"], train[2]["loss"]) == (13.0, 5.9)  # the rerun's
    assert train[1] == pytest.approx(
        {
            "kind": "train",
            "step": 20,
            "loss": 7.0,
            "samples_per_sec": 10.0,
            "lr": 1e-4,
            "tokens_per_sec_per_device": 1280.0,
            "tflops_per_device": 1.0,
            "mfu": 5.0,
            "peak_mem_gib": 1.2,
            "data_wait_pct": 2.0,
        }
    )
    assert [r for r in run.records if r["kind"] == "val"] == [
        {"kind": "val", "step": 25, "val_loss": 6.5}
    ]
    assert run.info == info() | {"time": run.info["time"]}
    assert cr.label_from_flags(run.info) == "bf16 hf"


def test_upstream_log_has_seed_lines_only(tmp_path: Path) -> None:
    """The upstream recipe's log: seed lines among other output, no detail line, no flags."""
    path = tmp_path / "slurm-202.out"
    path.write_text(
        "Loading checkpoint shards: 100%\n"
        + "".join(f"{metrics.seed_line(s, loss, v, 3e-4)}\n" for s, v, loss in BF16)
        + "Training done\n"
    )
    run = cr.load_run(path)
    assert [(r["step"], r["samples_per_sec"], r["loss"], r["lr"]) for r in run.records] == [
        (s, v, loss, 3e-4) for s, v, loss in BF16
    ]
    assert run.info is None and cr.default_labels([run]) == ["slurm-202"]
    assert compare_plot.throughput_key([run]) == "samples_per_sec"


def test_upstream_validation_lines_are_read_with_or_without_sruns_prefix(tmp_path) -> None:
    """Upstream's ``Batch N Validation loss: X`` (srun --label adds ``0: ``) gives the run its
    validation points; this recipe prints it after its own line, which stays the one record."""
    upstream = tmp_path / "slurm-203.out"
    upstream.write_text(
        f"0: {metrics.seed_line(10, 6.5, 2.0, 3e-4)}\n0: Batch 10 Validation loss: 6.25000\n"
        f"{metrics.seed_line(20, 5.5, 2.0, 3e-4)}\nBatch 20 Validation loss: 5.12500\n"
    )
    run = cr.load_run(upstream)
    assert [(r["step"], r["val_loss"]) for r in run.records if r["kind"] == "val"] == [
        (10, 6.25),
        (20, 5.125),
    ]
    ours = tmp_path / "slurm-204.out"
    ours.write_text(
        f"{metrics.seed_line(10, 6.5, 2.0, 3e-4)}\n"
        "Validation at step 10: loss 6.25000\nBatch 10 Validation loss: 6.25000\n"
    )
    assert [(r["kind"], r["step"]) for r in cr.load_run(ours).records] == [
        ("train", 10),
        ("val", 10),
    ]


def test_metrics_jsonl_with_a_partial_last_line(tmp_path: Path) -> None:
    run_dir = write_run_dir(tmp_path / "tiny-fp8", FP8[:2], [], info(fp8=True))
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 30, "loss": 6.')  # being written
    for source in (run_dir, run_dir / "metrics.jsonl"):
        run = cr.load_run(source)
        assert run.records == [train_record(*row) for row in FP8[:2]]
        assert run.fallback_label == "tiny-fp8"
        assert cr.label_from_flags(run.info) == "fp8 tensorwise hf"
    text = (run_dir / "metrics.jsonl").read_text()
    (run_dir / "metrics.jsonl").write_text(text.replace('"step": 20', '"step": 20 oops', 1) + "\n")
    with pytest.raises(cr.CompareError, match=r"metrics.jsonl: line 3 is not JSON"):
        cr.load_run(run_dir)


@pytest.mark.parametrize(
    "line, why",
    [
        ('{"kind": "train", "step": "30", "loss": 6.0}', "has step '30', not a whole number >= 0"),
        ('{"kind": "train", "step": -5, "loss": 6.0}', "has step -5, not a whole number >= 0"),
        ('{"kind": "train", "step": 30, "loss": "6.0"}', "has loss '6.0', not a number"),
        ('{"kind": "train", "step": 30}', "has no 'loss'"),
        ('{"kind": "val", "step": 30, "val_loss": {}}', "has val_loss {}, not a number"),
        (
            '{"kind": "train", "step": 30, "loss": 0.0}',
            "has loss 0.0: a cross-entropy loss is above 0",
        ),
        (
            '{"kind": "val", "step": 30, "val_loss": -1}',
            "has val_loss -1: a cross-entropy loss is above 0",
        ),
        ('{"kind": "run", "flags": 5}', "has flags 5, not an object"),
        (
            '{"kind": "run", "flags": {"max_steps": "50"}}',
            "has the flag max_steps '50', not a whole number",
        ),
        ("[1, 2]", "is not a JSON object"),
    ],
)
def test_a_malformed_record_is_refused_naming_its_line(tmp_path, capsys, line, why) -> None:
    """A string step died as a TypeError in the sort, flags that are no object as an
    AttributeError: like a line that is not JSON, refused with the file and line."""
    run_dir = write_run_dir(tmp_path / "tiny-fp8", FP8[:2], [], info(fp8=True))
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(line + "\n")
    other = write_run_dir(tmp_path / "tiny-bf16", BF16[:2], [], info())
    err = refused([str(other), str(run_dir), "--output", str(tmp_path / "o.png")], capsys)
    assert f"{run_dir / 'metrics.jsonl'}: line 4 {why}: fix or delete that line" in err
    assert not (tmp_path / "o.png").exists()


def test_a_log_s_run_line_names_the_record_it_is_labelled_by(tmp_path: Path) -> None:
    """train.py's run line is short (the record stays in the run folder); compare_runs reads a
    Slurm log's flags from the metrics.jsonl it names, and an older log's JSON line still."""
    run_dir = write_run_dir(tmp_path / "r", FP8, VAL["fp8"], info(fp8=True))
    line = metrics.run_line(run_dir / "metrics.jsonl", run_dir / "run.args")
    assert line == f"run: record in {run_dir / 'metrics.jsonl'}, flags in {run_dir / 'run.args'}"
    log = tmp_path / "slurm-8.out"
    log.write_text(
        "\n".join(
            ["0: 2026-12-04 10:00:00 I [train.py:271] " + line, *log_lines(FP8, VAL["fp8"], None)]
        )
        + "\n"
    )
    assert cr.default_labels([cr.load_run(log)]) == ["fp8 tensorwise hf"]
    # A fresh bf16 run in the same folder set the fp8 run's file aside: the log is still fp8's
    (run_dir / "metrics.jsonl").rename(run_dir / "metrics.1.jsonl")
    write_run_dir(run_dir, BF16, VAL["bf16"], info(max_steps=4))
    assert cr.default_labels([cr.load_run(log)]) == ["fp8 tensorwise hf"]
    assert cr.load_run(log).info["flags"]["max_steps"] == 50  # its warm-up, its checks
    for file in run_dir.glob("metrics*.jsonl"):  # the run folder is gone: the log's name
        file.unlink()
    assert cr.default_labels([cr.load_run(log)]) == ["slurm-8"]


def test_a_log_s_run_line_with_unusable_flags_is_not_ours(tmp_path: Path) -> None:
    """A log holds any text: like a run line that is not JSON, it is ignored (no flags: the run
    is labelled by its file name), where it raised AttributeError."""
    lines = log_lines(FP8[:2], [], None)
    log = tmp_path / "slurm-7.out"
    log.write_text("\n".join(['run: {"flags": 5}', *lines]) + "\n")
    run = cr.load_run(log)
    assert run.info is None and cr.default_labels([run]) == ["slurm-7"]


def test_a_name_over_255_bytes_is_one_line(two_runs, tmp_path, capsys) -> None:
    """ENAMETOOLONG from the first look at the path was a traceback."""
    long = tmp_path / ("n" * 300)
    err = refused([two_runs[0], str(long), "--output", str(tmp_path / "o.png")], capsys)
    assert f"{long}: cannot be read (File name too long)" in err
    err = refused([*two_runs, "--output", f"{long}.png"], capsys)
    assert f"--output {long}.png: File name too long" in err
    assert not (tmp_path / "o.png").exists()


# ------------------------------------------------------------------------ table and picture


@pytest.fixture
def two_runs(tmp_path: Path) -> list[str]:
    """bf16 as a run directory, fp8 as a Slurm log: the two kinds side by side."""
    bf16 = write_run_dir(tmp_path / "tiny-bf16", BF16, VAL["bf16"], info())
    log = tmp_path / "slurm-102.out"
    log.write_text("\n".join(log_lines(FP8, VAL["fp8"], info(fp8=True))) + "\n")
    return [str(bf16), str(log)]


def row(table: str, label: str) -> list[str]:
    return next(ln for ln in table.splitlines() if ln.strip().startswith(label)).split()


def test_a_caller_passes_options_and_gets_the_commands_output(two_runs, tmp_path, capsys) -> None:
    """make demo's path: typed Options (paths, labels, title) instead of a command line, the
    same table and picture as the command's."""
    png = tmp_path / "pair.png"
    pair = cr.Options([Path(two_runs[0]), Path(two_runs[1])], png, "bf16,fp8", title="Demo")
    assert cr.main(options=pair) == 0
    out = capsys.readouterr().out
    assert "ratios are to bf16." in out and out.endswith(f"Wrote {png}\n")
    assert png.stat().st_size > 10_000
    assert cr.main(options=cr.Options([two_runs[0]] * 2, png, "a,a")) == 2
    assert "--labels needs 2 distinct non-empty names" in capsys.readouterr().err


def test_table_holds_hand_computed_medians_and_ratios(two_runs, tmp_path, capsys) -> None:
    png = tmp_path / "out.png"
    assert cr.main([*two_runs, "--output", str(png)]) == 0
    out = capsys.readouterr().out
    assert "Medians after step 10; ratios are to bf16 hf." in out
    # Medians of steps 20-50 (step 10 is warm-up): bf16 10,14,12,11 -> 11.5; fp8 20,18,30,19
    # -> 19.5; the other metrics are fixed functions of the speed, memory is a max.
    assert row(out, "samples/s")[-3:] == ["11.50", "19.50", f"{19.5 / 11.5:.3f}"]
    assert row(out, "tokens/s/device")[-3:] == ["1,472", "2,496", f"{19.5 / 11.5:.3f}"]
    assert row(out, "TFLOP/s/device")[-3:] == ["1.150", "1.950", f"{19.5 / 11.5:.3f}"]
    assert row(out, "MFU")[-3:] == ["5.8", "9.8", f"{9.75 / 5.75:.3f}"]
    assert row(out, "data wait")[-3:] == ["3.5", "3.5", "1.000"]
    assert row(out, "peak memory")[-3:] == ["1.50", "1.50", "1.000"]
    assert row(out, "final train loss")[-3:] == ["5.00000", "5.05000", "1.010"]
    assert row(out, "final validation loss")[-3:] == ["5.20000", "5.25000", f"{5.25 / 5.2:.3f}"]
    assert out.rstrip().endswith(f"Wrote {png}")
    assert "not checked" not in out  # both runs carry their flags
    # judged from step 10 (the first tenth; warm-up 5); 20-step means of judged steps only, so
    # whole from step 30: (7.1+6.1)/(7+6) +1.54%, (6.1+5.6)/(6+5.5) +1.74%, (5.6+5.05)/(5.5+5)
    # +1.43%
    assert "train loss gap: mean +1.57%, largest +1.74% at step 40" in out
    assert "validation loss gap: mean +1.25%, largest +1.54%" in out
    # the last shared validation decides: 5.25 / 5.2 is +0.96%, inside the band, though the
    # last train windows are outside it
    assert (
        "verdict: fp8 tensorwise hf matches bf16 hf over steps 10-50: the validation loss gap "
        "+0.96% at step 50 is inside ±1.00%"
    ) in out
    # bf16's 6.5 at step 25 is fp8's at 25 + 25 * 0.1 / 1.35 = 26.85: 2 steps, 2 / 25 = 8% (the
    # share of the steps printed); its 5.2 at 50 not reached
    assert "step lag at bf16 hf's validations: 25 +2 (+8%), 50 >0 (not reached)" in out
    # at 1.696x the samples/s, fp8's step 50 takes bf16's time for step 29.5, where bf16's
    # validation loss reads 6.5 - 1.3 * 4.5 / 25 = 6.27 between its validations
    reference = 6.5 - 1.3 * (50 * 11.5 / 19.5 - 25) / 25
    assert f"loss is {5.25 / reference - 1:+.2%} from bf16 hf's at step 29," in out
    # fp8's 5.25 at step 50 is bf16's between 6.5 (step 25) and 5.2 (step 50): 25 + 25 * 1.25/1.3
    # = step 49, 0.98x the steps; times the 19.5/11.5 samples/s, 1.66x as fast to that loss
    assert (
        "same loss: fp8 tensorwise hf's validation loss at step 50 (5.2500) is bf16 hf's at step "
        "49 (0.98x the steps); at 1.696x its samples/s, fp8 tensorwise hf reaches that loss 1.66x "
        "as fast"
    ) in out


def upstream_log(path: Path, rows, val) -> Path:
    """The upstream recipe's log: seed lines and its validation lines, no detail or run line."""
    prefix = "0: 2024-05-15 02:37:59 I [train.py:110] "
    lines = [prefix + metrics.seed_line(step, loss, speed, 1e-4) for step, speed, loss in rows]
    lines += [f"{prefix}Batch {step} Validation loss: {loss}" for step, loss in val]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_upstream_logs_get_the_time_to_loss_from_their_samples_per_second(tmp_path, capsys) -> None:
    """Upstream's log has samples/s and no tokens/s: the steps-per-second ratio matched time and
    the same-loss speed need is there, and they are printed (they once were silently not)."""
    steps = range(1, 41)
    bf16 = upstream_log(tmp_path / "bf16.out", [(s, 30.0, 9 - s / 10) for s in steps], VAL40)
    fp8 = [(s, 45.0, 9.01 - s / 10) for s in steps]
    fp8 = upstream_log(tmp_path / "fp8.out", fp8, [(20, 7.02), (40, 5.02)])
    assert cr.main([str(bf16), str(fp8), "--output", str(tmp_path / "o.png")]) == 0
    out = capsys.readouterr().out
    assert "at 1.500x its samples/s, fp8 reaches that loss" in out
    assert "matched time: at its last validation, fp8's loss is" in out
    # bf16 fell 1% (5.05 to 5.0) in half a step of the line between its validations at 20 and 40
    assert "the band there (±1.00%) is bf16's fall over less than the one step (1%)" in out


def test_runs_on_different_numbers_of_devices_are_timed_whole(tmp_path, capsys) -> None:
    """FP8 on 4 ranks against BF16 on 2, one global batch: the per-device rows are marked, and
    time to loss uses the whole runs' samples/s (fp8's 1.2x), not tokens/s/device (0.6x)."""
    steps = range(1, 41)
    loss = {s: 9.0 - s / 10 for s in steps}
    bf16 = write_run_dir(tmp_path / "bf16", [(s, 10.0, loss[s]) for s in steps], VAL40, info())
    fp8_rows = [(s, 12.0, loss[s] + 0.01) for s in steps]
    fp8_info = info(fp8=True) | {"world_size": 4}
    fp8 = write_run_dir(tmp_path / "fp8", fp8_rows, [(20, 7.02), (40, 5.02)], fp8_info)
    assert cr.main([str(bf16), str(fp8), "--output", str(tmp_path / "o.png")]) == 0
    out = capsys.readouterr().out
    assert (
        "Devices differ (bf16 hf 2, fp8 tensorwise hf 4): the /device rows compare one "
        "device's work; samples/s, matched time and the same-loss speed compare the whole runs"
    ) in out
    assert "at 1.200x its samples/s" in out


VAL40 = [(20, 7.0), (40, 5.0)]


def test_a_speed_that_moved_within_a_run_makes_no_time_to_loss(tmp_path, capsys) -> None:
    """Tokens/s measured under changing load (here bf16 alternating 10 and 20 samples/s, 2x
    between its 10th- and 90th-percentile steps) once made "5.87x as fast": the speed is left
    out of the verdict's time-to-loss, and a line says why; a steady pair keeps it."""
    steps = range(1, 41)
    loss = {s: 9.0 - s / 10 for s in steps}
    bf16 = [(s, 10.0 if s % 2 else 20.0, loss[s]) for s in steps]
    fp8 = [(s, 16.0, loss[s] + 0.01) for s in steps]
    val = [(20, 7.0), (40, 5.0)]
    runs = [
        write_run_dir(tmp_path / "bf16", bf16, val, info()),
        write_run_dir(tmp_path / "fp8", fp8, [(20, 7.02), (40, 5.02)], info(fp8=True)),
    ]
    png = str(tmp_path / "o.png")
    assert cr.main([*map(str, runs), "--output", png]) == 0
    out = capsys.readouterr().out
    assert "speed: bf16 hf's samples/s varied 2.00x within the run" in out
    assert "same loss: fp8 tensorwise hf's validation loss at step 40" in out
    assert "as fast" not in out and "matched time:" not in out
    steady = write_run_dir(tmp_path / "steady", [(s, 12.0, loss[s]) for s in steps], val, info())
    assert cr.main([str(steady), str(runs[1]), "--output", png]) == 0
    out = capsys.readouterr().out
    assert "varied" not in out and "as fast" in out and "matched time:" in out


def test_three_runs_long_labels_stay_apart_in_the_bar_panel(two_runs) -> None:
    """The bar panel's names, drawn: three runs labelled as flags label them do not overlap."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    runs = [cr.load_run(p) for p in [*two_runs, two_runs[1]]]
    labels = ["bf16 te adamw8bit bf16-params", "fp8 delayed te fp8-attention", "fp8 current te"]
    summaries = [metrics.summarize(r.records, 10) for r in runs]
    fig = compare_plot.make_figure(runs, labels, summaries, judged_from=5)
    FigureCanvasAgg(fig).draw()
    bar_ax = next(ax for ax in fig.axes if ax.get_title().startswith("median"))
    boxes = [tick.get_window_extent() for tick in bar_ax.get_xticklabels()]
    assert len(boxes) == 3
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])


def test_png_has_the_expected_size_and_the_plotted_data_is_the_input(two_runs, tmp_path) -> None:
    png = tmp_path / "compare.png"
    args = cr.parse_args([*two_runs, "--output", str(png), "--log_steps", "--title", "CPU demo"])
    cr.compare(args)
    header = png.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", header[16:24]) == (2000, 450)  # FIGSIZE x DPI

    runs = [cr.load_run(p) for p in two_runs]
    labels = cr.default_labels(runs)
    summaries = [metrics.summarize(r.records, 10) for r in runs]
    fig = compare_plot.make_figure(
        runs, labels, summaries, log_steps=True, title="CPU demo", judged_from=7
    )
    loss_ax, gap_ax, speed_ax, bar_ax = fig.axes
    assert fig.get_suptitle() == "CPU demo" and labels == ["bf16 hf", "fp8 tensorwise hf"]
    lines = {ln.get_label(): ln for ln in loss_ax.get_lines()}
    first, second = (lines[f"{label} train"] for label in labels)
    assert first.get_linewidth() > second.get_linewidth()  # the first stays visible under
    assert first.get_linestyle() == "-" and second.get_linestyle() == "--"
    for label, rows, val in (
        ("bf16 hf", BF16, VAL["bf16"]),
        ("fp8 tensorwise hf", FP8, VAL["fp8"]),
    ):
        assert list(lines[f"{label} train"].get_xdata()) == [s for s, _, _ in rows]
        assert list(lines[f"{label} train"].get_ydata()) == pytest.approx([x for _, _, x in rows])
        assert list(lines[f"{label} validation"].get_xdata()) == [s for s, _ in val]
        assert list(lines[f"{label} validation"].get_ydata()) == pytest.approx([v for _, v in val])
        speed = next(ln for ln in speed_ax.get_lines() if ln.get_label() == label)
        assert list(speed.get_ydata()) == pytest.approx([v * 128 for _, v, _ in rows])
    assert loss_ax.get_xscale() == speed_ax.get_xscale() == gap_ax.get_xscale() == "log"
    # fp8 vs bf16: the verdict's gap (20-step means of the judged steps, here steps 10-50: whole
    # from step 30, the last two logged steps each), relative, in %, inside the ±1% parity
    # band, with the step the verdict judges from
    [gap] = [ln for ln in gap_ax.get_lines() if ln.get_label() == "fp8 tensorwise hf vs bf16 hf"]
    assert list(gap.get_xdata()) == [30, 40, 50]
    want = [100 * (13.2 / 13 - 1), 100 * (11.7 / 11.5 - 1), 100 * (10.65 / 10.5 - 1)]
    assert list(gap.get_ydata()) == pytest.approx(want)
    [band] = gap_ax.patches
    assert band.get_path().transformed(band.get_patch_transform()).vertices[:, 1].max() == 1.0
    [start] = [ln for ln in gap_ax.get_lines() if ln.get_label().startswith("judged from")]
    assert start.get_xdata()[0] == 7
    assert speed_ax.get_ylabel() == "tokens/s per device"
    assert [p.get_height() for p in bar_ax.patches] == pytest.approx([11.5 * 128, 19.5 * 128])
    assert [t.get_text() for t in bar_ax.texts] == ["1.00x", f"{19.5 / 11.5:.2f}x"]
    assert [t.get_text().replace("\n", " ") for t in bar_ax.get_xticklabels()] == labels


def test_loss_against_tokens_seen_and_a_run_without_them_refused(two_runs, tmp_path, capsys):
    """--x tokens: loss and throughput against each run's tokens seen (here one run takes twice
    the tokens a step); runs that record none (logs, earlier versions) are refused by name."""
    folders = []
    for name, rows, per_step in (("bf16", BF16, 1024), ("fp8", FP8, 2048)):
        (tmp_path / name).mkdir()
        folders.append(str(write_run_dir(tmp_path / name, rows, VAL[name], info(), per_step)))
    args = cr.parse_args([*folders, "--x", "tokens", "--output", str(tmp_path / "t.png")])
    cr.compare(args)
    runs = [cr.load_run(p) for p in folders]
    fig = compare_plot.make_figure(runs, ["a", "b"], [{}, {}], x="tokens", judged_from=5)
    loss_ax, _, speed_ax, _ = fig.axes
    lines = {ln.get_label(): list(ln.get_xdata()) for ln in loss_ax.get_lines()}
    assert lines["a train"] == [s * 1024 for s, _, _ in BF16]
    assert lines["b train"] == [s * 2048 for s, _, _ in FP8]
    assert lines["b validation"] == [2048 * 30, 2048 * 50]  # written after steps 30 and 50
    assert loss_ax.get_xlabel() == speed_ax.get_xlabel() == "tokens seen"
    err = refused([folders[0], two_runs[1], "--x", "tokens"], capsys)
    assert f"--x tokens: {two_runs[1]} record no tokens seen" in err


def profiled_pair(tmp_path: Path) -> list[str]:
    """Two run folders of the Llama 3.2 1B pair on an H100 (tests/traces: real TE traces), each
    with its run record and its trace window, as train.py --profile_steps leaves them."""
    folders = []
    for precision, rows, fp8 in (("bf16", BF16, False), ("fp8", FP8, True)):
        run = write_run_dir(tmp_path / f"1b-{precision}", rows, [], info(fp8=fp8))
        window = run / "profile" / "step_8"
        window.mkdir(parents=True)
        trace = ROOT / "tests" / "traces" / f"te_llama32_1b_{precision}.pt.trace.json.gz"
        (window / "rank_0.pt.trace.json.gz").write_bytes(trace.read_bytes())
        folders.append(str(run))
    return folders


def test_the_breakdown_panel_stacks_each_runs_step_and_states_the_ceiling(tmp_path, capsys) -> None:
    """--breakdown: a fifth panel with one bar per run whose segments are step_breakdown's
    categories (they add up to the slowest rank's step) and the pair's ceiling sentence, the
    one step_breakdown prints."""
    from analysis import step_breakdown

    runs_given = profiled_pair(tmp_path)
    png = tmp_path / "compare.png"
    assert cr.main([*runs_given, "--breakdown", "--output", str(png)]) == 0
    assert struct.unpack(">II", png.read_bytes()[16:24]) == (2500, 450)  # five panels

    runs = [cr.load_run(p) for p in runs_given]
    labels = cr.default_labels(runs)
    summaries = [metrics.summarize(r.records, 10) for r in runs]
    breakdown = cr.step_breakdowns(runs_given)
    fig = compare_plot.make_figure(runs, labels, summaries, breakdown=breakdown, judged_from=5)
    step_ax = fig.axes[4]
    read = [step_breakdown.read_run(Path(p), None) for p in runs_given]
    for row, run in enumerate(read):
        widths = [p.get_width() for p in step_ax.patches if round(p.get_y() + 0.4) == row]
        assert sum(widths) == pytest.approx(run.slowest.total_ms, rel=1e-6)
    sentence = step_breakdown.ceiling(read[0], read[1]).sentence()
    assert " ".join(step_ax.get_xlabel().split()) == f"ms per step {sentence}"
    assert "; ceiling " in sentence
    # Drawn: the sentence inside the picture, the legend on no bar.
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()
    label, legend = step_ax.xaxis.label, step_ax.get_legend()
    inside = fig.bbox.padded(1)
    assert all(inside.contains(x, y) for x, y in label.get_window_extent().corners())
    legend_box = legend.get_window_extent()
    assert not any(bar.get_window_extent().overlaps(legend_box) for bar in step_ax.patches)
    assert all(inside.contains(x, y) for x, y in legend_box.corners())
    assert step_breakdown.main([*runs_given, "--no_hta"]) == 0
    assert sentence in capsys.readouterr().out


def test_the_breakdown_of_a_run_without_traces_is_one_line(two_runs, tmp_path, capsys) -> None:
    err = refused([*two_runs, "--breakdown", "--output", str(tmp_path / "o.png")], capsys)
    assert "--breakdown: " in err and "--profile_steps START:END" in err
    assert not (tmp_path / "o.png").exists()


def test_the_breakdown_of_a_damaged_trace_is_one_line(tmp_path, capsys) -> None:
    """A trace whose .gz holds flipped bytes (zlib's error) was a traceback."""
    runs = profiled_pair(tmp_path)
    trace = Path(runs[1]) / "profile" / "step_8" / "rank_0.pt.trace.json.gz"
    whole = gzip.compress(b'{"traceEvents": []}', mtime=0)
    trace.write_bytes(whole[:10] + b"\x07" + whole[11:])  # a deflate block of the reserved type
    err = refused([*runs, "--breakdown", "--output", str(tmp_path / "o.png")], capsys)
    assert err == (
        f"compare_runs.py: error: --breakdown: {trace} cannot be read as a profiler trace: "
        "error('Error -3 while decompressing data: invalid block type'); profile it again or "
        "delete it\n"
    )
    assert not (tmp_path / "o.png").exists()


def test_a_run_is_never_labelled_by_another_runs_records(tmp_path) -> None:
    """A resume writes another run record of the same run: labelled by the first. A file or
    log holding a second identity (another precision, another --checkpoint_dir) used to be
    labelled by the first run's flags, its bf16 steps shown as fp8: refused, naming the line."""
    run_dir = write_run_dir(tmp_path / "r", FP8, VAL["fp8"], info(fp8=True))
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({**info(fp8=True), "kind": "run"}) + "\n")  # the run resumed
    assert cr.default_labels([cr.load_run(run_dir)]) == ["fp8 tensorwise hf"]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({**info(), "kind": "run"}) + "\n")
    with pytest.raises(cr.CompareError) as refused:
        cr.load_run(run_dir)
    assert str(refused.value) == (
        f"{run_dir / 'metrics.jsonl'}: line {len(lines) + 1} starts another run (fp8 True, now "
        f"False): the file holds two runs; split it at line {len(lines) + 1} and compare the parts"
    )
    log = tmp_path / "slurm-5.out"
    lines = log_lines(FP8, VAL["fp8"], info(fp8=True)) + log_lines([], [], info())
    log.write_text("\n".join(lines) + "\n")
    with pytest.raises(cr.CompareError, match=r"slurm-5.out: line \d+ starts another run \(fp8"):
        cr.load_run(log)
    # Another shape (any flag a resume of the run refuses) is another run too, and a change a
    # resume may make (the micro-batch, the logging) is the same run.
    mixed = write_run_dir(tmp_path / "m", FP8, VAL["fp8"], info(fp8=True))
    with open(mixed / "metrics.jsonl", "a") as f:
        f.write(json.dumps(info(fp8=True, train_batch_size=2, logging_freq=5)) + "\n")
    assert cr.load_run(mixed).info["flags"]["train_batch_size"] != 2
    with open(mixed / "metrics.jsonl", "a") as f:
        f.write(json.dumps(info(fp8=True, hidden_width=128)) + "\n")
    with pytest.raises(cr.CompareError, match=r"starts another run \(hidden_width 256, now 128\)"):
        cr.load_run(mixed)


def test_a_ratio_of_two_cells_that_print_zero_is_not_printed() -> None:
    """CPU runs: data wait 0.04% vs 0.02% printed 0.0, 0.0 and a ratio of 0.500; a TFLOP/s of
    0.0001234 printed 0.000 (the ratio, read back from a log, was 0/0)."""
    base = {"data_wait_pct": 0.04, "tflops_per_device": 0.0001234}
    other = {"data_wait_pct": 0.02, "tflops_per_device": 0.0002468}
    table = metrics.format_table([base, other], ["bf16", "fp8"])
    assert row(table, "data wait")[-3:] == ["0.0", "0.0", "-"]
    assert row(table, "TFLOP/s/device")[-3:] == ["0.0001234", "0.0002468", "2.000"]
    line = metrics.detail_line(
        {"tokens_per_sec_per_device": 5.0, "tflops_per_device": 0.0001234, "mfu": None}
        | {"peak_mem_gib": 0.5, "data_wait_pct": 0.0}
    )
    assert "TFLOP/s/device: 0.0001234," in line


# -------------------------------------------------------------------------------- refusals


def test_refuses_a_file_with_no_parsable_line(two_runs, tmp_path, capsys) -> None:
    junk = tmp_path / "slurm-9.out"
    junk.write_text("srun: error: Unable to allocate resources\n")
    err = refused([two_runs[0], str(junk), "--output", str(tmp_path / "o.png")], capsys)
    assert f"{junk}: no parsable line" in err
    err = refused([two_runs[0], str(tmp_path), "--output", str(tmp_path / "o.png")], capsys)
    assert "a directory without metrics.jsonl" in err
    assert "no such file" in refused([two_runs[0], str(tmp_path / "nope.out")], capsys)
    started = write_run_dir(tmp_path / "started", [], [], info(fp8=True))  # its run record only
    err = refused([two_runs[0], str(started)], capsys)
    assert f"{started / 'metrics.jsonl'}: no train record yet (the run logged no step)" in err
    assert not (tmp_path / "o.png").exists()


@pytest.mark.parametrize(
    "overrides, samples_per_step, why",
    [
        ({"num_layers": 8}, None, "num_layers 8 vs 4"),
        ({"hidden_width": 512}, None, "hidden_width 512 vs 256"),
        ({"max_context_width": 512}, None, "max_context_width 512 vs 256"),
        ({"train_batch_size": 16}, 32, "train_batch_size 16 vs 8"),
        ({}, 64, "global batch 64 vs 16"),  # same micro-batch, 4x the ranks
    ],
)
def test_refuses_unlike_runs_unless_allowed(
    two_runs, tmp_path, capsys, overrides, samples_per_step, why
) -> None:
    other = info(fp8=True, **overrides)
    if samples_per_step:
        other["samples_per_step"] = samples_per_step
    fp8 = write_run_dir(tmp_path / "other", FP8, [], other)
    png = tmp_path / "o.png"
    err = refused([two_runs[0], str(fp8), "--output", str(png)], capsys)
    assert f"fp8 tensorwise hf: {why} (bf16 hf)" in err and "--allow_mismatch" in err
    assert not png.exists()

    assert cr.main([two_runs[0], str(fp8), "--output", str(png), "--allow_mismatch"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith("  fp8 tensorwise hf *: ")  # the run is starred
    # and what differs comes before the table's ratios
    assert lines[3].startswith(f"* NOT LIKE FOR LIKE (--allow_mismatch): fp8 tensorwise hf: {why}")
    assert "fp8 tensorwise hf/bf16 hf" in lines[4]
    assert png.is_file()


@pytest.mark.parametrize(
    "output, why",
    [
        ("missing_dir/o.png", "is not a directory"),
        ("a_file/o.png", "is not a directory"),
        (".", "must end in .png"),
        ("o.txt", "must end in .png"),
        ("dir.png", "is a directory"),
    ],
)
def test_refuses_an_output_it_cannot_write(two_runs, tmp_path, capsys, output, why) -> None:
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "dir.png").mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    assert why in refused([*two_runs, "--output", str(tmp_path / output)], capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_refuses_a_read_only_directory(two_runs, tmp_path, capsys) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    assert "not writable" in refused([*two_runs, "--output", str(locked / "o.png")], capsys)


def test_labels_and_argument_refusals(two_runs, tmp_path, capsys) -> None:
    png = str(tmp_path / "o.png")
    assert cr.main([*two_runs, "--output", png, "--labels", "BF16, FP8 (ao)"]) == 0
    out = capsys.readouterr().out
    assert "FP8 (ao)/BF16" in out and "  BF16: " in out
    assert "2 distinct" in refused([*two_runs, "--output", png, "--labels", "a"], capsys)
    assert "2 distinct" in refused([*two_runs, "--output", png, "--labels", "a,a"], capsys)
    assert "two or more runs" in refused([two_runs[0], "--output", png], capsys)
    assert "--warmup_steps" in refused([*two_runs, "--warmup_steps", "-1"], capsys)
    last = cr.load_run(two_runs[0]).last_step  # past the runs' end: every median n/a
    said = refused([*two_runs, "--output", png, "--warmup_steps", str(last)], capsys)
    assert f"--warmup_steps {last} leaves no step: a run ends at {last}" in said
    # Labels from flags collide (two bf16 runs): the file names tell them apart.
    runs = [cr.load_run(two_runs[0]), cr.load_run(two_runs[0])]
    assert cr.default_labels(runs) == ["bf16 hf (tiny-bf16)", "bf16 hf (tiny-bf16) #2"]
    # A non-default --optimizer is part of the label.
    flags = {"flags": {"fp8": False, "bf16": True, "model_impl": "hf"}}
    assert cr.label_from_flags(flags) == "bf16 hf"
    flags["flags"]["optimizer"] = "adamw"
    assert cr.label_from_flags(flags) == "bf16 hf"
    flags["flags"]["optimizer"] = "adamw8bit"
    assert cr.label_from_flags(flags) == "bf16 hf adamw8bit"
    # FP8 attention tells an otherwise equal TE FP8 run apart.
    te = {"fp8": True, "fp8_recipe": "delayed", "model_impl": "te"}
    assert cr.label_from_flags({"flags": {**te, "fp8_attention": False}}) == "fp8 delayed te"
    assert (
        cr.label_from_flags({"flags": {**te, "fp8_attention": True}})
        == "fp8 delayed te fp8-attention"
    )
    # So does where the master weights live.
    assert cr.label_from_flags({"flags": {**te, "master_weights": "params"}}) == "fp8 delayed te"
    assert (
        cr.label_from_flags({"flags": {**te, "master_weights": "optimizer"}})
        == "fp8 delayed te bf16-params"
    )


def test_warmup_rule_is_train_py_s() -> None:
    source = (ROOT / "model_utils" / "report" / "run_log.py").read_text()
    assert "min(SPEED_WARMUP_STEPS, config.run.max_steps // 2)" in source


def test_the_default_picture_lands_in_the_last_run_folder_not_the_repo(
    tmp_path, capsys, monkeypatch
) -> None:
    """It was compare_runs.png in the current directory: run from the checkout, as the docs
    show, it left an untracked file in the repository."""
    bf16 = write_run_dir(tmp_path / "tiny-bf16", BF16, [], info())
    fp8 = write_run_dir(tmp_path / "tiny-fp8", FP8, [], info(fp8=True))
    monkeypatch.chdir(tmp_path)
    assert cr.main([str(bf16), str(fp8)]) == 0
    assert capsys.readouterr().out.endswith(f"Wrote {fp8 / 'compare_runs.png'}\n")
    assert (fp8 / "compare_runs.png").is_file() and not (tmp_path / "compare_runs.png").exists()
    log = tmp_path / "slurm-9.out"
    log.write_text("\n".join(log_lines(FP8, [], info(fp8=True))) + "\n")
    assert cr.main([str(bf16), str(log)]) == 0  # a log last: here, a git-ignored name
    assert (tmp_path / "compare_runs.png").is_file()
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "/compare_runs.png" in ignored


def test_replicas_set_the_band_and_must_be_seed_twins(two_runs, tmp_path, capsys) -> None:
    """A BF16 run with another --seed and the reference's data order is a replica: the verdict
    judges fp8 against the noise the two BF16 runs span, and the picture draws that band. A
    replica of another data order is refused, naming the flag."""
    replica_rows = [(s, v, loss * 1.02) for s, v, loss in BF16]
    replica_val = [(s, loss * 1.02) for s, loss in VAL["bf16"]]
    replica = write_run_dir(
        tmp_path / "tiny-bf16-43", replica_rows, replica_val, info(seed=43, data_seed=42)
    )
    png = tmp_path / "noise.png"
    runs = [two_runs[0], str(replica), two_runs[1]]
    assert cr.main([*runs, "--replicas", "2", "--output", str(png)]) == 0
    out = capsys.readouterr().out
    assert "seed noise of 1 replica(s) x2" in out and "  noise: " not in out
    verdict = (
        "verdict: fp8 tensorwise hf is within seed noise of bf16 hf (tiny-bf16) over steps 10-50"
    )
    assert verdict in out
    assert out.count("verdict:") == 1  # the replica is the band, not a judged run
    args = cr.parse_args([*runs, "--replicas", "2", "--output", str(png)])
    cr.compare(args)
    other = write_run_dir(tmp_path / "tiny-bf16-7", replica_rows, replica_val, info(seed=7))
    assert cr.main([two_runs[0], str(other), two_runs[1], "--replicas", "2"]) == 2
    err = capsys.readouterr().err
    assert "a replica must read the reference's data: --data_seed 42 (--replicas)" in err
    copy = write_run_dir(tmp_path / "tiny-bf16-44", BF16, VAL["bf16"], info(seed=44))
    assert cr.main([two_runs[0], str(copy), two_runs[1], "--replicas", "2"]) == 2
    err = capsys.readouterr().err  # another --seed that changed nothing (an --init_from_hf run)
    assert "tiny-bf16-44): every loss it logged is bf16 hf (tiny-bf16)'s, so it measures" in err
    assert cr.main([*runs, "--replicas", "3"]) == 2
    assert "at least one run after them to judge" in capsys.readouterr().err


def test_the_picture_draws_the_replicas_noise_band(two_runs, tmp_path) -> None:
    from analysis import parity

    runs = [cr.load_run(p) for p in two_runs]
    labels = cr.default_labels(runs)
    summaries = [metrics.summarize(r.records, 10) for r in runs]
    noise = parity.Noise(1, {30: 0.02, 40: 0.03}, {})
    fig = compare_plot.make_figure(runs, labels, summaries, judged_from=7, noise=noise)
    gap_ax = fig.axes[1]
    [band] = gap_ax.collections
    assert band.get_label() == "seed noise (1 replica(s))"
    assert band.get_paths()[0].vertices[:, 1].max() == pytest.approx(3.0)


# ------------------------------------------------------------------------------- --tracker


def test_a_bad_tracker_is_refused_in_one_line_before_anything_is_written(
    two_runs, tmp_path, capsys, monkeypatch
) -> None:
    """An unknown name, a tracker whose package is missing, and "the runs' trackers" of runs
    trained with none: one line, exit 2, no picture and no comparison folder."""
    png = tmp_path / "o.png"
    before = sorted(tmp_path.iterdir())
    err = refused([*two_runs, "--output", str(png), "--tracker", "wandb,neptune"], capsys)
    assert "--tracker: unknown tracker 'neptune'; choose from tensorboard, wandb, mlflow" in err
    assert "--tracker runs: the runs were trained with no tracker" in refused(
        [*two_runs, "--output", str(png), "--tracker", "runs"], capsys
    )
    monkeypatch.setitem(flag_rules.TRACKER_PACKAGES, "mlflow", "no_such_package_for_this_test")
    err = refused([*two_runs, "--output", str(png), "--tracker", "tensorboard,mlflow"], capsys)
    assert "--tracker mlflow needs the no_such_package_for_this_test package" in err
    assert sorted(tmp_path.iterdir()) == before


def test_the_runs_trackers_are_those_they_were_trained_with(tmp_path) -> None:
    bf16 = cr.load_run(write_run_dir(tmp_path / "a", BF16, [], info(tracker="wandb")))
    fp8 = cr.load_run(write_run_dir(tmp_path / "b", FP8, [], info(tracker="mlflow,wandb")))
    board = cr.load_run(write_run_dir(tmp_path / "c", FP8, [], info(tensorboard=True)))
    infos = [run.info for run in (bf16, fp8, board)]
    assert tracker_names("runs", infos) == ["wandb", "mlflow", "tensorboard"]
    assert tracker_names(" TensorBoard ,wandb", infos) == ["tensorboard", "wandb"]
    assert tracker_names("", infos) == []


def test_tensorboard_gets_the_gap_band_picture_and_verdict(tmp_path, capsys) -> None:
    """--tracker tensorboard: a run of its own beside the runs, read back by TensorBoard's
    reader: the gap per step is the picture's gap line, the band the fixed ±1%, the picture is
    the PNG's size, the verdict and report the printed ones."""
    from helpers.tensorboard_events import read_events, series

    bf16 = write_run_dir(tmp_path / "tiny-bf16", BF16, VAL["bf16"], info())
    fp8 = write_run_dir(tmp_path / "tiny-fp8", FP8, VAL["fp8"], info(fp8=True))
    png = tmp_path / "ab.png"
    assert cr.main([str(bf16), str(fp8), "--output", str(png), "--tracker", "tensorboard"]) == 0
    out = capsys.readouterr().out
    home = tmp_path / "compare-tiny-bf16-vs-tiny-fp8"
    assert f"The comparison in the trackers ({home}): tensorboard: {home / 'tensorboard'}" in out
    events = read_events(home / "tensorboard")
    runs = [cr.load_run(p) for p in (bf16, fp8)]
    judged = parity.gaps_of(runs[1].records, runs[0].records, 10)
    steps, gaps = judged.whole, judged.train
    gap = series(events, "compare/train_loss_gap_pct/fp8 tensorwise hf")
    assert gap == pytest.approx({s: 100 * g for s, g in zip(steps, gaps, strict=True)})
    assert series(events, "compare/band_pct") == {s: pytest.approx(1.0) for s in steps}
    [picture] = events.Images("compare/picture")
    assert (picture.step, picture.width, picture.height) == (50, 2000, 450)

    def text(tag: str) -> str:
        [event] = events.Tensors(f"{tag}/text_summary")
        return event.tensor_proto.string_val[0].decode()

    verdict = (
        "fp8 tensorwise hf matches bf16 hf over steps 10-50: the validation loss gap +0.96% at "
        "step 50 is inside ±1.00%"
    )
    assert f"  verdict: {verdict}" in out and text("compare/verdict") == verdict
    report = out.split("\nThe comparison in the trackers")[0]
    assert text("compare/report") == "\n".join("    " + ln for ln in report.splitlines())
    assert "| labels | bf16 hf, fp8 tensorwise hf |" in text("flags")


def test_metrics_md_shows_what_the_stored_h200_pair_prints_today(tmp_path, capsys) -> None:
    """docs/metrics.md's parity sample is the stored 1B pair read back by today's code, line
    for line: a change to the verdict's words or arithmetic shows here, not in a user's run."""
    stored = ROOT / "benchmarks/results/2026-11-28-h200-parity/runs.tgz"
    with tarfile.open(stored) as tar:
        tar.extractall(tmp_path, filter="data")
    png = tmp_path / "c.png"
    assert cr.main([str(tmp_path / "bf16"), str(tmp_path / "fp8"), "--output", str(png)]) == 0
    printed = capsys.readouterr().out.splitlines()
    page = (ROOT / "docs" / "metrics.md").read_text()
    sample = re.search(r"```\n(Parity of fp8 delayed te .*?)```", page, re.S)[1].splitlines()
    start = printed.index(sample[0])
    assert printed[start : start + len(sample)] == sample


def test_a_resume_that_changed_the_batch_or_the_validation_set_is_not_like_for_like(
    tmp_path, capsys
) -> None:
    """Each run record of a metrics.jsonl counts, not the first alone: a run resumed with
    another micro-batch mixes two batches' figures; twins validated on other sets compare no
    validation loss."""
    bf16 = write_run_dir(tmp_path / "bf16", BF16, VAL["bf16"], info())
    fp8 = write_run_dir(tmp_path / "fp8", FP8, VAL["fp8"], info(fp8=True))
    with (fp8 / "metrics.jsonl").open("a") as file:
        file.write(json.dumps(info(fp8=True, train_batch_size=2)) + "\n")
    err = refused([str(bf16), str(fp8)], capsys)
    assert "fp8 tensorwise hf: train_batch_size 2 after a resume (8 before)" in err
    other = write_run_dir(
        tmp_path / "fp8-val", FP8, VAL["fp8"], info(fp8=True, validation_batches=9)
    )
    assert "validation_batches 9 vs" in refused([str(bf16), str(other)], capsys)


def test_the_table_s_warm_up_follows_the_last_launch_s_max_steps(tmp_path) -> None:
    """A run resumed with a longer --max_steps summarises after min(10, its new max // 2) steps;
    the table uses the same, not the first launch's."""
    first = write_run_dir(tmp_path / "a", BF16, [], info(max_steps=16))
    assert cr.default_warmup([cr.load_run(first)]) == 8
    with (first / "metrics.jsonl").open("a") as file:
        file.write(json.dumps(info(max_steps=28)) + "\n")
    assert cr.default_warmup([cr.load_run(first)]) == 10


def test_a_short_third_run_moves_no_other_pair_s_judged_steps(tmp_path, capsys) -> None:
    """Each pair is judged from its own start: a crashed 20-step run beside the pair would pull
    the pair's start into the loss's steep fall (the first tenth of the shortest run)."""
    rows = [(step, 10.0, 9.0 - 0.03 * step) for step in range(2, 101, 2)]
    flags = {"max_steps": 100, "warmup": 2}
    bf16 = write_run_dir(tmp_path / "bf16", rows, [], info(**flags))
    fp8 = write_run_dir(tmp_path / "fp8", rows, [], info(fp8=True, **flags))
    short = write_run_dir(tmp_path / "short", rows[:10], [], info(fp8=True, max_steps=20))
    png = str(tmp_path / "c.png")
    for runs in ([bf16, fp8], [bf16, fp8, short]):
        labels = ",".join(["bf16", "fp8", "short"][: len(runs)])
        assert cr.main([*map(str, runs), "--labels", labels, "--output", png]) == 0
        out = capsys.readouterr().out
        assert "Parity of fp8 with bf16, steps 10-100 " in out  # the first tenth of 100


def test_a_log_s_loss_of_0_and_a_run_given_twice_are_refused(two_runs, tmp_path, capsys) -> None:
    """A log's records hold a metrics.jsonl's rules (a loss of 0 was judged "matches" from a
    log); a run compared with itself says nothing."""
    log = tmp_path / "zero.out"
    log.write_text("\n".join(log_lines(FP8, VAL["fp8"], info(fp8=True))) + "\n")
    lines = log.read_text().splitlines()
    bad = next(i for i, line in enumerate(lines) if "Batch 30 Loss:" in line)
    lines[bad] = lines[bad].replace("Loss: 6.10000", "Loss: 0.00000")
    log.write_text("\n".join(lines) + "\n")
    png = str(tmp_path / "c.png")
    err = refused([two_runs[0], str(log), "--output", png], capsys)
    assert f"{log}: line {bad + 1} has loss 0.0: a cross-entropy loss is above 0" in err
    for again in (two_runs[0] + "/", two_runs[0] + "/metrics.jsonl"):  # the folder or its file
        err = refused([two_runs[0], again, "--output", png], capsys)
        assert f"{two_runs[0]} is given twice: each run is compared once" in err


def test_a_relaunch_s_first_steps_in_a_log_are_its_warm_up(tmp_path: Path) -> None:
    """A requeued job's log holds both launches: the second warms up (and compiles) again, which
    its metrics.jsonl records mark and its log did not, so the log's medians counted it."""
    rows = [(step, 10.0, 9.0 - step / 100) for step in range(10, 101, 10)]
    run_dir = write_run_dir(tmp_path / "r", rows, [], info(fp8=True, max_steps=100))
    line = "0: 2026-12-04 10:00:00 I [train.py:285] " + metrics.run_line(
        run_dir / "metrics.jsonl", run_dir / "run.args"
    )
    first, second = log_lines(rows[:5], [], None), log_lines(rows[5:], [], None)
    log = tmp_path / "slurm-9.out"
    log.write_text("\n".join([line, *first, line, *second]) + "\n")
    warm = {r["step"] for r in cr.load_run(log).records if r.get("speed_warmup")}
    assert warm == {60}  # the relaunch's first 10 steps; the first launch's: the table's warm-up
