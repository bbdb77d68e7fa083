"""--tracker's rules (names, packages) and the tracker-run ids a resume reads back; a tracker that
fails mid-run is dropped with one warning while the others go on."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest

from model_utils.config import flag_rules
from model_utils.config.arguments import UsageError, parse_args
from model_utils.config.options import TRACKERS
from model_utils.report import trackers


def test_names_are_parsed_checked_and_deduplicated() -> None:
    assert flag_rules.tracker_names(" wandb, MLflow,wandb,,") == ["wandb", "mlflow"]
    assert flag_rules.tracker_names("") == []
    with pytest.raises(UsageError, match="unknown tracker 'neptune'"):
        flag_rules.tracker_names("wandb,neptune")


def test_the_flag_is_normalised_and_tensorboard_is_one_of_its_names() -> None:
    args = parse_args(["--preset", "tiny", "--tracker", "TensorBoard, tensorboard"])
    assert args.run.tracker == "tensorboard"
    with pytest.raises(UsageError, match="--tracker: unknown tracker 'tb'"):
        parse_args(["--preset", "tiny", "--tracker", "tb"])


def test_a_missing_package_is_a_usage_error_with_the_install_line(monkeypatch) -> None:
    monkeypatch.setitem(flag_rules.TRACKER_PACKAGES, "wandb", "no_such_package_for_this_test")
    with pytest.raises(UsageError, match=r"needs the no_such_package_for_this_test package"):
        flag_rules.check_tracker_packages(["tensorboard", "wandb"])


@pytest.mark.parametrize("uri", ["file:///tmp/mlruns", "/tmp/mlruns", "mlruns"])
def test_a_file_store_mlflow_refuses_is_one_line_before_the_start(uri: str, monkeypatch) -> None:
    """MLflow 3 refuses a file store unless told: it was a warning mid-log, cut before the fix
    (MLflow's message is 600 characters), and a run without MLflow."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(UsageError) as refused:
        parse_args(["--preset", "tiny", "--tracker", "mlflow"])
    assert str(refused.value) == (
        f"--tracker mlflow: MLFLOW_TRACKING_URI={uri} is a file store, which MLflow 3 refuses: "
        "use sqlite:///PATH/mlflow.db or a server, or set MLFLOW_ALLOW_FILE_STORE=true"
    )
    parse_args(["--preset", "tiny", "--tracker", "wandb"])  # MLflow's setting, MLflow's rule
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    parse_args(["--preset", "tiny", "--tracker", "mlflow"])
    for store in ("sqlite:///tmp/mlflow.db", "http://host:5000", "databricks"):
        flag_rules.check_mlflow_store({"MLFLOW_TRACKING_URI": store})


def test_ids_round_trip_and_a_damaged_file_reads_as_none_in_one_line(tmp_path, caplog) -> None:
    assert trackers.read_ids(tmp_path) == {} and not caplog.records  # none yet: nothing to say
    trackers.write_ids(tmp_path, {"wandb": "abc", "mlflow": "0f"})
    assert trackers.read_ids(tmp_path) == {"wandb": "abc", "mlflow": "0f"}
    for damaged in ("{not json", "[1, 2]"):
        caplog.clear()
        (tmp_path / trackers.IDS_FILE).write_text(damaged)
        assert trackers.read_ids(tmp_path) == {}
        [warning] = [r for r in caplog.records if r.levelname == "WARNING"]
        message = warning.getMessage()
        assert message.startswith(f"{tmp_path / trackers.IDS_FILE} cannot be read (")
        assert "the trackers start new runs" in message and "\n" not in message


class _Fails:
    name, id = "broken", None

    def __init__(self, *opened: object) -> None:
        pass

    def write(self, record: dict) -> None:
        raise ConnectionError("server went away\ntraceback detail")

    def close(self) -> None:
        raise AssertionError("a dropped tracker is not closed")


class _Keeps:
    name, id = "kept", "k1"
    opened: list[_Keeps] = []

    def __init__(self, run: dict, output_dir: str, run_id: str | None, start_step: int) -> None:
        self.run_id, self.start_step = run_id, start_step
        self.steps: list[int] = []
        self.closed = False
        _Keeps.opened.append(self)

    def write(self, record: dict) -> None:
        self.steps.append(record["step"])

    def close(self) -> None:
        self.closed = True


class _Stalls:
    """A server that stops answering: every call waits until the test lets it go."""

    name, id = "stalled", None
    release = threading.Event()
    writing = threading.Event()

    def __init__(self, *opened: object) -> None:
        pass

    def write(self, record: dict) -> None:
        self.writing.set()
        self.release.wait(60)

    def close(self) -> None:
        self.release.wait(60)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_each_tracker_row_opens_the_sink_of_its_name() -> None:
    """A tracker is one row of config.options.TRACKERS (its name, package and sink class) and its
    class: --tracker, the package check, the help and the sinks all read that row."""
    assert (
        [row.name for row in TRACKERS] == list(flag_rules.TRACKER_PACKAGES) == list(trackers.SINKS)
    )
    for row in TRACKERS:
        sink = trackers.SINKS[row.name]
        assert sink.__name__ == row.sink and sink.name == row.name
        assert callable(sink.write) and callable(sink.publish) and callable(sink.close)


def test_a_failing_tracker_is_one_warning_and_the_others_go_on(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    monkeypatch.setitem(trackers.SINKS, "broken", _Fails)
    monkeypatch.setitem(trackers.SINKS, "kept", _Keeps)
    trackers.write_ids(tmp_path, {"kept": "k1"})
    with caplog.at_level(logging.INFO, logger="train"):
        group = trackers.Trackers(
            ["broken", "kept", "unknown"], {}, str(tmp_path), enabled=True, start_step=4
        )
        for step in (5, 6):
            group.write({"kind": "train", "step": step, "loss": 1.0})
        group.close()
    assert _warnings(caplog) == [
        "broken failed (ConnectionError: server went away): no more broken this run; training "
        "goes on (metrics.jsonl and this log carry the same numbers)"
    ]
    [kept] = _Keeps.opened[-1:]
    assert (kept.run_id, kept.start_step, kept.steps, kept.closed) == ("k1", 4, [5, 6], True)
    assert "kept: continuing run k1" in caplog.messages


def test_a_server_that_stops_answering_never_stalls_a_step(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    """Writes return while the tracker is stuck; the end waits its bound and says so once."""
    monkeypatch.setitem(trackers.SINKS, "stalled", _Stalls)
    _Stalls.release.clear()
    group = trackers.Trackers(["stalled"], {}, str(tmp_path), enabled=True, close_timeout_s=0.2)
    try:
        for step in range(1, 4):  # a synchronous write would wait here for the release
            group.write({"kind": "train", "step": step, "loss": 1.0})
        assert _Stalls.writing.wait(60) and not _Stalls.release.is_set()
        with caplog.at_level(logging.WARNING, logger="train"):
            group.close()
    finally:
        _Stalls.release.set()
    [warning] = _warnings(caplog)
    assert warning.startswith("stalled did not finish within 0 s (2 records not sent;")
    assert warning.endswith("metrics.jsonl and this log carry every figure")


def test_a_server_that_does_not_answer_is_one_warning_and_no_wait(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    """Nothing on the port, and a port that takes connections and drops them: the start is
    on the trackers' thread (the run does not wait for it), and the only line is the one
    warning, no HTTP retry lines before it."""
    pytest.importorskip("mlflow", reason="pip install -e '.[trackers]'")
    from helpers.endpoints import silent_hub
    from helpers.procs import free_port

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")
    monkeypatch.delenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", raising=False)
    run = {"flags": {"fp8": False, "bf16": True}, "world_size": 1}
    with silent_hub() as hub:
        for uri in (f"http://alice:s3cret@127.0.0.1:{free_port()}", hub.url):
            caplog.clear()
            monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
            with caplog.at_level(logging.WARNING):  # every logger, urllib3's too
                group = trackers.Trackers(["mlflow"], run, str(tmp_path), enabled=True)
                group.close()
            [warning] = _warnings(caplog)
            assert warning.startswith("mlflow cannot start (")
            assert warning.endswith("): training goes on without it"), warning
            assert "s3cret" not in caplog.text  # the tracking URI's password stays out of the log
            assert group.active == [] and not (tmp_path / trackers.IDS_FILE).exists()
        assert hub.connections >= 1
    assert os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] == "true"  # no "View run at: URL"


def test_ab_twins_are_two_runs_of_one_experiment_in_the_local_store(
    tmp_path: Path, monkeypatch
) -> None:
    """No MLFLOW_TRACKING_URI: runs/mlflow.db beside the run folders, shared by both halves,
    each run tagged with its precision; reopening a folder's id continues its run."""
    pytest.importorskip("mlflow", reason="pip install -e '.[trackers]'")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "twins")
    ids = {}
    for label, fp8 in (("fp8", True), ("bf16", False)):
        out = tmp_path / f"tiny-{label}"
        out.mkdir()
        run = {"flags": {"fp8": fp8, "bf16": True, "max_steps": 2}, "world_size": 1}
        group = trackers.Trackers(["mlflow"], run, str(out), enabled=True)
        group.write({"kind": "train", "step": 1, "time": 1.0, "loss": 3.0, "mfu": None})
        group.close()
        again = trackers.Trackers(["mlflow"], run, str(out), enabled=True, start_step=1)
        again.write({"kind": "val", "step": 2, "time": 2.0, "val_loss": 2.5})
        again.close()
        ids[label] = trackers.read_ids(out)["mlflow"]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    found = client.search_runs([client.get_experiment_by_name("twins").experiment_id])
    assert sorted((r.data.tags["precision"], r.info.run_id) for r in found) == sorted(
        (label, run_id) for label, run_id in ids.items()
    )
    for r in found:
        assert r.data.metrics == {"train/loss": 3.0, "val/val_loss": 2.5}
        assert r.info.run_name == f"tiny-{r.data.tags['precision']}"
    # A resume whose store lacks the run (another MLFLOW_TRACKING_URI) gets a new run, not none.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'other.db'}")
    moved = trackers.Trackers(
        ["mlflow"], run, str(tmp_path / "tiny-fp8"), enabled=True, start_step=2
    )
    moved.write({"kind": "train", "step": 3, "time": 3.0, "loss": 2.0, "mfu": None})
    moved.close()
    assert trackers.read_ids(tmp_path / "tiny-fp8")["mlflow"] not in ids.values()
    assert MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'other.db'}").get_run(
        trackers.read_ids(tmp_path / "tiny-fp8")["mlflow"]
    ).data.metrics == {"train/loss": 2.0}
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    # A fresh start in a folder (step 0, or another run's) never continues the run it holds.
    out = tmp_path / "tiny-fp8"
    restart = trackers.Trackers(["mlflow"], {"flags": {"fp8": True}}, str(out), enabled=True)
    restart.close()
    assert trackers.read_ids(out)["mlflow"] not in ids.values()
