"""--tensorboard's writer: every number of a record as a scalar of its kind, read back by
TensorBoard's own reader; a resume purges the steps it re-runs."""

from __future__ import annotations

import sys
from pathlib import Path

from helpers.tensorboard_events import flags_text, read_events, series

from model_utils.config.arguments import parse_args
from model_utils.report import metrics, trackers
from model_utils.report.trackers import TensorBoardTracker, flags_markdown, scalars


def test_scalars_are_every_number_of_a_record_by_kind() -> None:
    train = {
        "kind": "train",
        "step": 3,
        "time": 1.0,
        "loss": 2.5,
        "mfu": None,
        "samples": 8,
        "mfu_basis": "n/a",
        "remaining_seconds": None,
        "elapsed_seconds": 4.0,
    }
    assert scalars(train) == [
        ("train/loss", 2.5),
        ("train/samples", 8.0),
        ("train/elapsed_seconds", 4.0),
    ]
    val = metrics.validation_record(step=3, val_loss=2.0, batches=2, seconds=0.5)
    assert scalars(val) == [
        ("val/val_loss", 2.0),
        ("val/val_batches", 2.0),
        ("val/val_seconds", 0.5),
    ]
    assert scalars({"kind": "run", "step": 0, "world_size": 2}) == []
    table = flags_markdown({"flags": {"fp8": True, "fp8_recipe": "a|b"}, "world_size": 2})
    assert table.splitlines() == [
        "| flag | value |",
        "|---|---|",
        "| fp8 | True |",
        "| fp8_recipe | a/b |",
        "| world_size | 2 |",
    ]  # a field the record lacks (a comparison's has no world size) is no row


def test_writer_round_trip_and_resume_purges_the_rerun_steps(tmp_path: Path, caplog) -> None:
    def record(step: int, loss: float) -> dict:
        return {"kind": "train", "step": step, "loss": loss, "time": 1000.0 + step}

    run = metrics.run_record({"fp8": True}, world_size=2, samples_per_step=16)
    with caplog.at_level("INFO"):
        board = TensorBoardTracker(run, str(tmp_path), None)
    events_dir = tmp_path / "tensorboard"
    assert (  # where the events go, and a command that opens the run's (and earlier ones')
        f"TensorBoard events go to {events_dir}; to watch them: {sys.executable} -m "
        f"tensorboard.main --logdir {tmp_path} (then open http://localhost:6006)"
    ) in caplog.messages
    for step in range(1, 6):
        board.write(record(step, 10.0 - step))
    board.write(metrics.validation_record(step=5, val_loss=4.5, batches=2, seconds=0.1))
    # Written at each report (flushed), visible before close: a preempted run loses nothing.
    assert series(read_events(events_dir), "train/loss") == {s: 10.0 - s for s in range(1, 6)}
    board.close()
    assert "| fp8 | True |" in flags_text(read_events(events_dir))
    # Resumed from the step-3 checkpoint: steps 4 and 5 are trained again, with new losses.
    resumed = TensorBoardTracker(run, str(tmp_path), None, start_step=3)
    for step in (4, 5):
        resumed.write(record(step, 100.0 + step))
    resumed.close()
    events = read_events(events_dir)
    assert series(events, "train/loss") == {1: 9.0, 2: 8.0, 3: 7.0, 4: 104.0, 5: 105.0}
    assert [e.wall_time for e in events.Scalars("train/loss")][:3] == [1001.0, 1002.0, 1003.0]
    assert len(events.Tensors("flags/text_summary")) == 2  # each launch's flags (a resume's too)

    off = trackers.Trackers(["tensorboard"], {"flags": {}}, str(tmp_path / "off"), enabled=False)
    off.write(record(1, 1.0))
    off.close()
    assert not (tmp_path / "off").exists()  # not rank 0: no sink
    assert parse_args([]).run.tensorboard is False  # off by default
    assert parse_args(["--tensorboard"]).run.tensorboard is True


def test_only_tensorboard_writer_threads_disk_errors_go_unprinted(monkeypatch) -> None:
    """The quiet hook drops the OSError of TensorBoard's own writer thread (the main thread
    warns about it) and passes every other thread's error to the hook it replaced."""
    import threading

    from tensorboard.summary.writer import event_file_writer

    printed: list[str] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: printed.append(args.thread.name))
    trackers._quiet_writer_thread_errors()
    trackers._quiet_writer_thread_errors()  # installed once, not wrapped twice

    def fail(exc: Exception) -> None:
        raise exc

    class WriterThread(threading.Thread):  # what TensorBoard's _AsyncWriterThread is, by module
        pass

    WriterThread.__module__ = event_file_writer.__name__
    for thread in (
        WriterThread(target=fail, args=(OSError(28, "No space left on device"),), name="tb-disk"),
        WriterThread(target=fail, args=(ValueError("a bug"),), name="tb-bug"),
        threading.Thread(target=fail, args=(OSError(28, "full"),), name="other-disk"),
    ):
        thread.start()
        thread.join()
    assert printed == ["tb-bug", "other-disk"]
